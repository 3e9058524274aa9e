"""The NVMe tier's storage: per-rank swap files, their reads and writes, host staging buffers.

- `folder.py`: the per-rank swap folder under `nvme_path`: created and locked at initialize
  with a clear error when the path is missing, not writable or too small; removed at
  destroy() and on a clean exit; a killed run's folder (its lock free) cleared at the next
  start, never read.
- `backends.py`: positioned reads and writes of host memory: KvikIO (NVIDIA's file I/O
  library, a thread pool over POSIX I/O or GPUDirect Storage) where it works, Python's own
  positioned I/O (`os.preadv` / `os.pwritev` on a thread pool) elsewhere; direct I/O where
  the file system takes it.
- `io.py`: one request (a byte range of a file) issued as `aio.block_size` calls, at most
  `queue_depth` in flight, as the `aio` section says.
- `buffers.py`: the page-aligned host staging buffers (`buffer_count` of them).
- `pager.py`: swap groups (one file each) read into and written from those buffers,
  asynchronously: the next group read while the current one is used, writes behind.

It knows bytes and files only; what the bytes are is its users' business: masters and
optimizer state (zero3/optim/nvme_state.py), parameter shards (zero3/params/nvme_shards.py).

May import: `zero3.config`. Sits in the foundation layer.
"""
