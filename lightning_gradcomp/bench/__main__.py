"""``python -m lightning_gradcomp.bench VERB ...``, VERB one of link, shaped, codecs, codes, accuracy, score,
pcaquant, pcabasis, tta, memory, plot."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "link": "step time over a real shaped network (namespaces + tc), every codec against the floor",
    "shaped": "one recipe run across shaped hosts, one rank each, the link's rate changed mid-run if asked",
    "codecs": "encode + decode cost of each codec on real gradients, one process",
    "accuracy": "task metric against bytes sent: the recipes with a fixed budget per codec and seed",
    "score": "the final checkpoints of accuracy runs scored again, e.g. on every test image",
    "codes": "what a code of lgc's shared-support values carries at equal bytes, learned or not, on real gradients",
    "pcaquant": "how much of the gradient gradiveq's coefficient quantization loses, per scale and rounding",
    "pcabasis": "how much of the summed gradient gradiveq's basis captures, by the rank or step it is fitted on",
    "tta": "time to accuracy on a slow link: accuracy runs' steps to target x link runs' step time",
    "memory": "RSS and peak RSS per rank early and late in a long compressed run (a leak shows as growth)",
    "plot": "figures and docs/benchmarks.md tables from the JSON results",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_gradcomp.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        mod = importlib.import_module(f"lightning_gradcomp.bench.{name}")
        p = sub.add_parser(name, help=help_text, description=mod.__doc__.split("\n\n")[0])
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with the results
    rc = int(args._module.main(args) or 0)
    if rc == 0 and args.command == "tta" and args.figure:  # tta computes, plot draws: no import circle
        from lightning_gradcomp.bench.plot import plot_tta_figures

        for path in plot_tta_figures(args):
            print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
