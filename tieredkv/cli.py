"""Command line: `tieredkv run [CONFIG]`, `tieredkv serve [CONFIG] [--model M]`."""

from __future__ import annotations

import argparse
import logging
import sys

from tieredkv import serve

DEFAULT_CONFIG = "configs/demo.yaml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tieredkv",
        description="Tiered KV cache offloading engine for LLM inference (GPU HBM, pinned CPU, NVMe).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run", help="run a YAML experiment and print its summary",
        description="Build the engine from a YAML file, run its workload with a progress bar and print a "
        "summary table (requests, tokens/s, TTFT and inter-token latency percentiles, prefix hits per tier, "
        "preemptions, bytes moved); writes OUT/<name>/result.json and PNG plots.",
    )
    run.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"YAML file (default: {DEFAULT_CONFIG})")
    run.add_argument("--compare", action="store_true",
                     help="run every entry of the file's `variants:` list and print them side by side")
    run.add_argument("--out", default="results", help="where result.json and the plots go (default: results/)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--prometheus-port", type=int, metavar="PORT",
                     help="serve the engine's stats and the clients' latencies at :PORT/metrics while the run "
                     "lasts (needs prometheus-client)")
    serve.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        build_parser().print_help()
        return 0
    if args.command == "serve":
        return serve.main(args)
    from tieredkv.experiment.harness import format_comparison, format_summary, run_experiment
    from tieredkv.experiment.prometheus import PrometheusExporter

    exporter = None
    try:
        if args.prometheus_port is not None:
            exporter = PrometheusExporter(args.prometheus_port)
            print(f"Prometheus metrics at http://localhost:{exporter.port}/metrics", flush=True)
        summaries = run_experiment(args.config, args.out, args.compare, use_tqdm=not args.no_progress,
                                   on_summary=lambda s: print(format_summary(s), flush=True), exporter=exporter)
    except ValueError as err:
        print(f"tieredkv: error: {err}", file=sys.stderr)
        return 2
    finally:
        if exporter is not None:
            exporter.close()
    if len(summaries) > 1:
        print(format_comparison(summaries))
    print(f"results in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
