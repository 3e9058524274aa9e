"""A model, not a measurement: zero3's step time at 8, 64 and 512 GPUs, from measured compute.

Inputs: the measured compute time of one step of one rank (forward + backward), the number
of fetch units (transformer layers) and the bytes each unit gathers, and NCCL's bus
bandwidth and per-hop latency as parameters. What it assumes, in the α-β ring model:

- a ring all-gather or reduce-scatter of S bytes (the whole tensor) over N ranks takes
  (N - 1) * alpha + (N - 1) / N * S / busbw: the bus bandwidth is what nccl-tests report;
- a rank's compute per step does not change with N (data parallel, fixed micro-batch); the
  backward of a unit costs twice its forward;
- per unit and pass, zero3 issues one all-gather of the unit's parameters (forward, and
  again in backward) and one reduce-scatter of its gradients (backward), the bytes
  checked against the arithmetic on the GPU tier (tests/gpu/sharded_checks.py);
- with prefetch on, the next unit's all-gather runs while this unit computes, so a unit
  costs max(compute, communication); prefetch off, compute + communication. The
  reduce-scatter runs on its own stream in backward, overlapping the next unit's compute.

Defaults are the 1B Llama of bench/ (16 layers of 2048 / 5632, bf16, sequence 2048,
micro-batch 2), whose step took 91 ms at world size 1 on one H100
(bench/results/h100/1b_ab_sealing.log). Prints, per world size and bandwidth, the time a
unit's collectives take against its compute, the step time with and without prefetch, and
the prefetch bucket and live-parameter bound that keep one unit in flight.

    python3 bench/comm_model.py [--step-ms 91 --layers 16 --hidden 2048 --intermediate 5632]
"""

from __future__ import annotations

import argparse


def ring_time(nbytes: float, ranks: int, busbw: float, alpha: float) -> float:
    """Seconds of a ring all-gather / reduce-scatter of `nbytes` (the whole tensor)."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) * alpha + (ranks - 1) / ranks * nbytes / busbw


def unit_numel(hidden: int, intermediate: int, kv_ratio: float) -> int:
    """Parameters of one Llama decoder layer: attention (q, o full; k, v by kv_ratio) and MLP."""
    attention = 2 * hidden * hidden + 2 * int(hidden * hidden * kv_ratio)
    return attention + 3 * hidden * intermediate + 2 * hidden


def project(args: argparse.Namespace) -> list[dict]:
    numel = unit_numel(args.hidden, args.intermediate, args.kv_ratio)
    gather_bytes = numel * args.param_bytes
    reduce_bytes = numel * args.grad_bytes
    forward_unit = args.step_ms / 1e3 / (3 * args.layers)
    backward_unit = 2 * forward_unit
    rows = []
    for busbw_gbs, alpha_us, where in ((args.intra_busbw, args.intra_alpha, "inside a node"),
                                       (args.inter_busbw, args.inter_alpha, "across nodes")):
        for ranks in args.ranks:
            if (where == "inside a node") != (ranks <= args.gpus_per_node):
                continue
            bw, alpha = busbw_gbs * 1e9, alpha_us * 1e-6
            gather = ring_time(gather_bytes, ranks, bw, alpha)
            reduce = ring_time(reduce_bytes, ranks, bw, alpha)
            forward_on = max(forward_unit, gather)
            backward_on = max(backward_unit, gather + reduce)
            step_on = args.layers * (forward_on + backward_on)
            step_off = args.layers * (forward_unit + gather + backward_unit + gather + reduce)
            rows.append({
                "where": where, "ranks": ranks, "busbw": busbw_gbs, "gather_ms": gather * 1e3,
                "reduce_ms": reduce * 1e3, "forward_ms": forward_unit * 1e3, "backward_ms": backward_unit * 1e3,
                "hidden": gather <= forward_unit and gather + reduce <= backward_unit,
                "step_on_ms": step_on * 1e3, "step_off_ms": step_off * 1e3,
                "efficiency": args.step_ms / (step_on * 1e3),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=91.0, help="measured compute of one step, one rank")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--kv-ratio", type=float, default=1.0, help="k/v projection width over hidden")
    parser.add_argument("--param-bytes", type=int, default=2, help="bytes of a gathered parameter (bf16: 2)")
    parser.add_argument("--grad-bytes", type=int, default=2, help="bytes of a reduced gradient element")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-busbw", type=float, default=350.0, help="GB/s inside a node (NVLink)")
    parser.add_argument("--intra-alpha", type=float, default=5.0, help="µs per ring hop inside a node")
    parser.add_argument("--inter-busbw", type=float, default=50.0, help="GB/s across nodes")
    parser.add_argument("--inter-alpha", type=float, default=15.0, help="µs per ring hop across nodes")
    args = parser.parse_args()
    numel = unit_numel(args.hidden, args.intermediate, args.kv_ratio)
    print("A MODEL, NOT A MEASUREMENT (alpha-beta ring; see the module docstring for what it assumes)")
    print(f"unit: {numel / 1e6:.1f} M parameters, {numel * args.param_bytes / 1e6:.0f} MB gathered, "
          f"{numel * args.grad_bytes / 1e6:.0f} MB reduced; measured step {args.step_ms} ms at world size 1 "
          f"over {args.layers} units")
    header = (f"{'where':<14}{'ranks':>6}{'GB/s':>6}{'gather ms':>11}{'reduce ms':>11}{'fwd ms':>8}"
              f"{'bwd ms':>8}{'hidden':>8}{'step, prefetch':>16}{'step, none':>12}{'vs compute':>12}")
    print(header)
    for row in project(args):
        print(f"{row['where']:<14}{row['ranks']:>6}{row['busbw']:>6.0f}{row['gather_ms']:>11.2f}"
              f"{row['reduce_ms']:>11.2f}{row['forward_ms']:>8.2f}{row['backward_ms']:>8.2f}"
              f"{'yes' if row['hidden'] else 'NO':>8}{row['step_on_ms']:>14.1f}ms{row['step_off_ms']:>10.1f}ms"
              f"{row['efficiency']:>11.0%}")
    print(f"Defaults: zero3 prefetches the next unit whenever less than stage3_prefetch_bucket_size "
          f"elements are in flight, so the default 5e7 keeps one unit ({numel:.2e} elements) in flight, and "
          f"stage3_max_live_parameters must hold two units ({2 * numel:.2e}; the default 1e9 does). "
          "Prefetching deeper does not raise the bandwidth ceiling: where a unit's gather outlasts its "
          "compute, only a larger micro-batch (more compute per byte) or sharding inside a node hides it.")


if __name__ == "__main__":
    main()
