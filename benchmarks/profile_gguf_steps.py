"""Device time per kernel of one prompt prefill and one decode step of a model file on OpenCL (profiling events),
for files whose mix of weight formats benchmarks/profile_steps.py's random int4 model does not have (Q4_K_M: Q4_K
and Q6_K matrices).

    python benchmarks/profile_gguf_steps.py MODEL.gguf [--prompt 512] [--device N]

Two unprofiled prefills first (kernels built, weights placed), then one profiled prefill of --prompt random tokens
and one decode step after it. One line per step: total device ms and ms per kernel name, largest first.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import perfx_core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--device")
    args = parser.parse_args()
    model = perfx_core.load(args.model, backend="opencl", device=args.device, context_length=2 * args.prompt)
    engine, rt = model.engine, model.engine.rt
    ids = [int(i) for i in np.random.default_rng(0).integers(100, model.config.vocab_size, args.prompt)]
    try:
        for _ in range(2):
            engine.prefill(ids, slot=0)
        rt.synchronize()
        steps = (
            (f"prefill {args.prompt}", lambda: engine.prefill(ids, slot=0)),
            (f"decode at {args.prompt}", lambda: engine.decode([ids[0]], [0], [args.prompt])),
        )
        for label, step in steps:
            with rt.profiling():
                rt.kernel_seconds()
                step()
                seconds = rt.kernel_seconds()
            by_kernel = {k: round(1e3 * v, 3) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
            print(f"{label} total ms {1e3 * sum(seconds.values()):.3f} {json.dumps(by_kernel)}")
    finally:
        model.close()


if __name__ == "__main__":
    main()
