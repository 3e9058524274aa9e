"""`deepspeed.runtime.swap_tensor.utils`: DeepSpeed 0.19.8's swap sizes (bytes)."""

MIN_AIO_BYTES = 1024 ** 2  # the smallest asynchronous I/O DeepSpeed issues
AIO_ALIGNED_BYTES = 1024  # DeepSpeed aligns swap buffers to this
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES  # a tensor smaller than this is never swapped to NVMe

__all__ = ["AIO_ALIGNED_BYTES", "MIN_AIO_BYTES", "MIN_SWAPPABLE_BYTES"]
