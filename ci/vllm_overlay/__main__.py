"""Command line of the overlay tooling: ``ci/overlay COMMAND``.

Build steps print their one result (a path) on stdout and progress on
stderr, so build.sh can pass each result to the next step.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from vllm_overlay import (
    apply,
    build,
    dist,
    fetch,
    manifest,
    overlay,
    rebase,
    series,
    source,
    wheelcheck,
    workspace,
)
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, default_layout
from vllm_overlay.pin import load_pin
from vllm_overlay.proc import run_logged


def cmd_fetch_wheel(layout: Layout, args: argparse.Namespace) -> str:
    pin = load_pin(layout.pin)
    official = fetch.fetch(pin.wheel, layout.downloads)
    wheelcheck.check_official_torch(official, pin.wheel_torch, layout.pin)
    return str(official)


def _lay_upstream(layout: Layout, dest: Path) -> str:
    """A fresh copy of the pinned upstream at ``dest``, saying which source."""
    source.fresh_dir(dest)
    upstream = source.lay_scratch_tree(
        layout.root, load_pin(layout.pin), layout.downloads, dest
    )
    print(f"  source: {upstream.description}", file=sys.stderr)
    return str(dest)


def cmd_prepare_tree(layout: Layout, args: argparse.Namespace) -> str:
    source.fresh_dir(layout.tree)
    return _lay_upstream(layout, layout.partial_tree)


def cmd_apply(layout: Layout, args: argparse.Namespace) -> str:
    """What build.sh does up to the build: a fresh tree with the series and
    overlay in it, for looking at or running upstream's tests against."""
    tree = Path(cmd_prepare_tree(layout, args))
    apply.apply_series(tree, series.load_series(layout.patches))
    return cmd_copy_overlay(layout, argparse.Namespace(tree=tree))


def cmd_pristine_tree(layout: Layout, args: argparse.Namespace) -> str:
    return _lay_upstream(layout, layout.pristine_tree)


def cmd_apply_series(layout: Layout, args: argparse.Namespace) -> str:
    apply.apply_series(args.tree, series.load_series(layout.patches))
    return str(args.tree)


def cmd_copy_overlay(layout: Layout, args: argparse.Namespace) -> str:
    overlay.copy_overlay(layout.overlay, args.tree)
    if args.tree.resolve() == layout.partial_tree.resolve():
        source.fresh_dir(layout.tree)
        layout.partial_tree.rename(layout.tree)
        return str(layout.tree)
    return str(args.tree)


def cmd_stamp(layout: Layout, args: argparse.Namespace) -> str:
    data = manifest.build_manifest(
        load_pin(layout.pin),
        series.load_series(layout.patches),
        overlay.overlay_files(layout.overlay),
        args.mode,
    )
    manifest.write_manifest(args.tree, data)
    return str(args.tree)


def cmd_manifest(layout: Layout, args: argparse.Namespace) -> str:
    return json.dumps(manifest.read_manifest(args.tree), indent=2, sort_keys=True)


def cmd_image_args(layout: Layout, args: argparse.Namespace) -> str:
    wheels = sorted(layout.dist.glob("*.whl"))
    if len(wheels) != 1:
        raise OverlayError(
            f"{layout.dist} holds {len(wheels)} wheels, not one", "run ./build.sh first"
        )
    data = manifest.read_manifest(layout.tree)
    if data["version"] not in wheels[0].name:
        raise OverlayError(
            f"build/tree is not the tree of {wheels[0].name}", "run ./build.sh again"
        )
    return shlex.join(manifest.image_args(data, wheels[0].name))


def cmd_build_wheel(layout: Layout, args: argparse.Namespace) -> str:
    pin = load_pin(layout.pin)
    patches = series.load_series(layout.patches)
    wheel = build.build_wheel(
        args.tree,
        pin,
        args.mode,
        official_wheel=args.official,
        touched=overlay.touched_files(layout),
        build_requirements=layout.build_requirements,
        cache_dir=layout.cache,
        out_dir=layout.wheel_dir,
        log_dir=layout.logs,
        source_date_epoch=series.source_date_epoch(patches, pin.source_date),
    )
    return str(wheel)


def cmd_check_wheel(layout: Layout, args: argparse.Namespace) -> str:
    pin = load_pin(layout.pin)
    wheelcheck.check_wheel(
        args.wheel,
        args.official,
        args.tree,
        overlay.touched_files(layout),
        pin.overlay_version,
        pin.wheel_tag,
    )
    return str(args.wheel)


def cmd_publish(layout: Layout, args: argparse.Namespace) -> str:
    return str(dist.publish(args.wheel, layout.dist, layout.build))


def cmd_lint(layout: Layout, args: argparse.Namespace) -> str:
    problems = [
        f"{patch.path}: {problem}"
        for patch in series.load_series(layout.patches)
        for problem in series.header_problems(patch) + series.diff_problems(patch)
    ]
    if problems:
        raise OverlayError(
            "\n".join(problems),
            "fill in the DEP-3 headers; fix diffs in build/workspace and "
            "`ci/overlay export` (README, 'Work on the series')",
        )
    return "series ok"


def cmd_lint_upstream(layout: Layout, args: argparse.Namespace) -> str:
    """ruff, with upstream's own configuration, on the files we change."""
    files = sorted(f for f in overlay.patched_files(layout) if f.endswith(".py"))
    if not files:
        return "no patched upstream Python files"
    for ruff_args in (["check"], ["format", "--check"]):
        run_logged(
            [str(args.python.absolute()), "-m", "ruff", *ruff_args, *files],
            layout.logs / "ruff-upstream.log",
            cwd=args.tree,
        )
    return f"ruff clean on {len(files)} patched or added upstream files"


def cmd_workspace(layout: Layout, args: argparse.Namespace) -> str:
    _lay_upstream(layout, layout.workspace)
    workspace.make_workspace(
        layout.workspace, series.load_series(layout.patches), args.upto
    )
    return str(layout.workspace)


def cmd_new(layout: Layout, args: argparse.Namespace) -> str:
    workspace.new_patch(layout.workspace, args.name)
    return f"committed {args.name}: edit its header with `git commit --amend`"


def cmd_export(layout: Layout, args: argparse.Namespace) -> str:
    names = workspace.export(layout.workspace, layout.patches)
    return f"exported {len(names)} patches to {layout.patches}"


def cmd_rebase_check(layout: Layout, args: argparse.Namespace) -> str:
    pin = load_pin(layout.pin)
    rebase.dry_run(
        pin,
        series.load_series(layout.patches),
        args.versions,
        layout.downloads,
        layout.build / "rebase",
        args.json,
        args.write,
    )
    return f"report: {args.json}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ci/overlay", description=__doc__)
    parser.add_argument("--root", type=Path, help="checkout to work on")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.set_defaults(func=func)
        return p

    add("fetch-wheel", cmd_fetch_wheel, "download and verify the official wheel")
    add("apply", cmd_apply, "build/tree: fresh upstream + series + overlay")
    add("prepare-tree", cmd_prepare_tree, "lay a fresh upstream scratch tree")
    add("pristine-tree", cmd_pristine_tree, "the unpatched tree, for comparisons")
    add(
        "apply-series", cmd_apply_series, "apply patches/series, zero fuzz"
    ).add_argument("tree", type=Path)
    add(
        "copy-overlay", cmd_copy_overlay, "add overlay/ files to the tree"
    ).add_argument("tree", type=Path)
    p = add("stamp", cmd_stamp, "write the provenance manifest into the tree")
    p.add_argument("tree", type=Path)
    p.add_argument("--mode", choices=build.MODES, default="assemble")
    add("manifest", cmd_manifest, "print the manifest a tree carries").add_argument(
        "tree", type=Path
    )
    add("image-args", cmd_image_args, "docker build arguments for Containerfile")
    p = add("build-wheel", cmd_build_wheel, "build the wheel of a tree")
    p.add_argument("tree", type=Path)
    p.add_argument("--mode", choices=build.MODES, default="assemble")
    p.add_argument("--official", type=Path, required=True)
    p = add("check-wheel", cmd_check_wheel, "compare a wheel with the official")
    p.add_argument("wheel", type=Path)
    p.add_argument("--tree", type=Path, required=True)
    p.add_argument("--official", type=Path, required=True)
    add("publish", cmd_publish, "move a checked wheel into dist/").add_argument(
        "wheel", type=Path
    )
    add("lint", cmd_lint, "check the series and its DEP-3 headers")
    add(
        "workspace", cmd_workspace, "the series as git commits in build/workspace"
    ).add_argument("--upto", metavar="PATCH", help="stop after this patch")
    add("new", cmd_new, "commit workspace changes as a new patch").add_argument("name")
    add("export", cmd_export, "write build/workspace's commits to patches/")
    p = add("rebase-check", cmd_rebase_check, "dry-run the series on other releases")
    p.add_argument("versions", nargs="+", metavar="VERSION")
    p.add_argument("--json", type=Path, default=Path("build/rebase/report.json"))
    p.add_argument(
        "--write",
        action="store_true",
        help="refresh the patches that apply, with a pin, per version",
    )
    p = add("lint-upstream", cmd_lint_upstream, "ruff on patched upstream files")
    p.add_argument("tree", type=Path)
    p.add_argument("--python", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    layout = Layout(args.root.resolve()) if args.root else default_layout()
    try:
        print(args.func(layout, args))
    except OverlayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; dist/ was left as it was", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
