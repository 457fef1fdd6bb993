"""Command line of the overlay tooling: ``ci/overlay COMMAND``.

Build steps print their one result (a path) on stdout and progress on
stderr, so build.sh can pass each result to the next step.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_overlay import (
    adopt,
    apply,
    backport,
    build,
    consumer_dist,
    dist,
    fetch,
    gate,
    lint,
    manifest,
    notice,
    overlay,
    rebase,
    rebase_state,
    series,
    source,
    wheelcheck,
    workspace,
)
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, default_layout, target_layout
from vllm_overlay.pin import load_pin
from vllm_overlay.proc import run_logged


def cmd_check(layout: Layout, args: argparse.Namespace) -> str:
    patches = overlay.check_checkout(layout)
    version = overlay.labelled_pin(layout).overlay_version
    return f"checkout ok: {len(patches)} patches, version {version}"


def cmd_fetch_wheel(layout: Layout, args: argparse.Namespace) -> str:
    return str(_official_wheel(layout))


def _official_wheel(layout: Layout) -> Path:
    pin = load_pin(layout.pin)
    official = fetch.fetch(pin.wheel, layout.downloads)
    wheelcheck.check_official_torch(official, pin.wheel_torch, layout.pin)
    return official


def _lay_upstream(layout: Layout, dest: Path) -> str:
    """A fresh copy of the pinned upstream at ``dest``, saying which source."""
    source.fresh_dir(dest)
    upstream = source.lay_scratch_tree(
        layout.root, load_pin(layout.pin), layout.downloads, dest
    )
    print(f"  source: {upstream.description}", file=sys.stderr)
    return str(dest)


def _lay_tree(layout: Layout, mode: str) -> Path:
    """A fresh upstream tree to patch (``layout.partial_tree``)."""
    upstream = source.lay_build_tree(
        layout.root,
        load_pin(layout.pin),
        layout.cache,
        layout.downloads,
        layout.tree,
        layout.partial_tree,
        # vLLM's setup.py (the other modes) writes into the tree in place.
        {t for p in series.load_series(layout.patches) for t in p.targets}
        if mode == "assemble"
        else None,
    )
    print(f"  source: {upstream.description}", file=sys.stderr)
    return layout.partial_tree


def _add_overlay(layout: Layout, tree: Path) -> Path:
    """The overlay's files into the patched ``tree``, which then becomes
    ``layout.tree``: a tree is complete only once they are in."""
    overlay.copy_overlay(layout.overlay, tree)
    source.fresh_dir(layout.tree)
    tree.rename(layout.tree)
    return layout.tree


def cmd_apply(layout: Layout, args: argparse.Namespace) -> str:
    """What build.sh does up to the build: a fresh tree with the series and
    overlay in it, for looking at or running upstream's tests against."""
    build.check_writable(layout.cache)
    with build.one_at_a_time(layout.build):
        tree = _lay_tree(layout, "assemble")
        apply.apply_series(tree, series.load_series(layout.patches), layout.command)
        return str(_add_overlay(layout, tree))


def cmd_pristine_tree(layout: Layout, args: argparse.Namespace) -> str:
    return _lay_upstream(layout, layout.pristine_tree)


def _apply_series(layout: Layout, tree: Path, official: Path) -> None:
    patches = series.load_series(layout.patches)
    wheelcheck.check_base_matches_official(
        tree, official, {t for p in patches for t in p.targets}
    )
    apply.apply_series(tree, patches, layout.command)


def _stamp(layout: Layout, tree: Path, mode: str) -> None:
    """The provenance manifest and the notice, into ``tree``."""
    pin = overlay.labelled_pin(layout)
    patches = series.load_series(layout.patches)
    overlay_files = overlay.overlay_files(layout.overlay)
    data = manifest.build_manifest(pin, patches, overlay_files, mode)
    manifest.write_manifest(tree, data)
    notice.write_notice(tree, notice.render(pin, patches, overlay_files))


def cmd_manifest(layout: Layout, args: argparse.Namespace) -> str:
    return _manifest(args.tree)


def _manifest(tree: Path) -> str:
    return json.dumps(manifest.read_manifest(tree), indent=2, sort_keys=True)


def cmd_image_args(layout: Layout, args: argparse.Namespace) -> str:
    """Labels from the manifest inside the wheel that goes into the image, not
    from build/tree: after an interrupted build the two differ."""
    distribution = load_pin(layout.pin).distribution
    wheels = sorted(layout.dist.glob(f"{distribution}-*.whl"))
    if len(wheels) != 1:
        raise OverlayError(
            f"{layout.dist} holds {len(wheels)} {distribution} wheels, not one",
            "run ./build.sh first",
        )
    data = manifest.read_wheel_manifest(wheels[0])
    return shlex.join(manifest.image_args(data, wheels[0].name))


def _build_wheel(
    layout: Layout, tree: Path, mode: str, official: Path
) -> tuple[Path, str | None]:
    pin = overlay.labelled_pin(layout)
    patches = series.load_series(layout.patches)
    return build.build_wheel(
        tree,
        pin,
        mode,
        official_wheel=official,
        touched=overlay.touched_files(layout),
        build_requirements=layout.build_requirements,
        cache_dir=layout.cache,
        out_dir=layout.wheel_dir,
        log_dir=layout.logs,
        source_date_epoch=series.source_date_epoch(patches, pin.source_date),
    )


def _check_wheel(layout: Layout, wheel: Path, tree: Path, official: Path) -> None:
    pin = overlay.labelled_pin(layout)
    wheelcheck.check_wheel(
        wheel,
        official,
        tree,
        overlay.touched_files(layout),
        pin.overlay_version,
        pin.wheel_tag,
    )


def cmd_publish(layout: Layout, args: argparse.Namespace) -> str:
    return str(dist.publish(args.wheel, layout.dist, layout.build, also=args.also))


def cmd_build_consumer(layout: Layout, args: argparse.Namespace) -> str:
    return str(_build_consumer(layout, args.tree, args.wheel))


def _build_consumer(layout: Layout, tree: Path, wheel: Path) -> Path:
    """The reference consumer's own wheel (consumer_dist.py), from a tree
    and the engine wheel built from it (its version and requirements)."""
    patches = series.load_series(layout.patches)
    pin = load_pin(layout.pin)
    return consumer_dist.build_consumer_wheel(
        tree,
        wheel,
        layout.consumer_wheel_dir,
        series.source_date_epoch(patches, pin.source_date),
    )


def _step(text: str) -> None:
    print(f"==> {text}", file=sys.stderr, flush=True)


def cmd_build(layout: Layout, args: argparse.Namespace) -> str:
    """build.sh's steps in one process, each announced: one interpreter
    start, and the official wheel hashed once."""
    _step("check the checkout (pin, series, overlay)")
    print(cmd_check(layout, args), file=sys.stderr)
    dist.refuse_symlink(layout.dist.absolute())
    build.check_writable(layout.cache)
    with build.one_at_a_time(layout.build):
        return str(_build(layout, args.mode))


def _build(layout: Layout, mode: str) -> Path:
    _step("fetch and verify the official wheel")
    official = _official_wheel(layout)
    _step("lay a fresh upstream tree")
    tree = _lay_tree(layout, mode)
    _step(f"apply {layout.patches.relative_to(layout.root).as_posix()}/series")
    _apply_series(layout, tree, official)
    _step("copy overlay/")
    tree = _add_overlay(layout, tree)
    _step("write the provenance manifest")
    _stamp(layout, tree, mode)
    _step(f"build the wheel ({mode})")
    wheel, sha256 = _build_wheel(layout, tree, mode, official)
    _step("check the wheel against the official one")
    _check_wheel(layout, wheel, tree, official)
    also = []
    if not layout.target:  # one consumer wheel: the main target's schema
        _step(f"build the consumer wheel ({consumer_dist.DISTRIBUTION})")
        also.append(_build_consumer(layout, tree, wheel))
    _step("publish to dist/")
    published = dist.publish(wheel, layout.dist, layout.build, sha256, also)
    print(_manifest(tree), file=sys.stderr)
    return published


def cmd_patch_map(layout: Layout, args: argparse.Namespace) -> str:
    return series.patch_map(series.load_series(layout.patches)).rstrip("\n")


def cmd_lint(layout: Layout, args: argparse.Namespace) -> str:
    return lint.lint(layout)


def cmd_lint_upstream(layout: Layout, args: argparse.Namespace) -> str:
    """ruff, with upstream's own configuration and version, on the files we
    change."""
    files = sorted(f for f in overlay.patched_files(layout) if f.endswith(".py"))
    if not files:
        return "no patched upstream Python files"
    python = (args.python or rebase.ruff_python(layout, args.tree)).absolute()
    for ruff_args in (["check"], ["format", "--check"]):
        run_logged(
            [str(python), "-m", "ruff", *ruff_args, *files],
            layout.logs / "ruff-upstream.log",
            cwd=args.tree,
        )
    return f"ruff clean on {len(files)} patched or added upstream files"


def cmd_workspace(layout: Layout, args: argparse.Namespace) -> str:
    ws = (args.dir or layout.workspace).absolute()
    if args.cont or args.skip:
        workspace.continue_workspace(ws, args.skip)
        state = workspace.State.load(ws)
        if state is not None and state.rebase:  # build/.../rebase/VERSION/workspace
            owner = target_layout(layout.root, state.target)
            return rebase.finish(owner, ws, ws.parent.name, args.python)
        return str(ws)
    if args.dir is not None:
        raise OverlayError(
            "--dir names an existing workspace for --continue or --skip",
            f"run `{layout.command} workspace` without --dir to make "
            f"{layout.workspace}",
        )
    patches = overlay.check_checkout(layout)
    if locks := workspace.busy(ws):
        raise OverlayError(
            f"a git process is working in {ws} (it holds "
            f"{', '.join(str(p) for p in locks)}); making the workspace again now "
            "would fail half-way",
            "wait for it to finish, then run the command again; if no git runs "
            f"there any more, remove what it left: `rm {' '.join(map(str, locks))}`",
        )
    if not args.force and (lost := workspace.unsaved_work(ws)):
        raise OverlayError(
            f"{ws} holds work that making it again would discard:\n  "
            + "\n  ".join(lost),
            f"save it: {_save_steps(layout, ws, lost)}; or discard it: "
            f"`{layout.command} workspace --force`",
        )
    pin = load_pin(layout.pin)
    # The upstream tree the base commit holds: the same one is reused.
    release = (
        f"upstream/ at {pin.commit or pin.commit_short}"
        if source.is_populated_checkout(layout.root / "upstream")
        else f"sdist sha256 {pin.sdist.sha256}"
    )
    if workspace.remake(ws, patches, args.upto, release):
        print(f"  reused the {release} tree of {ws}", file=sys.stderr)
        return str(ws)
    _lay_upstream(layout, ws)
    workspace.make_workspace(ws, patches, args.upto, layout.patches, release)
    return str(ws)


def _save_steps(layout: Layout, ws: Path, lost: list[str]) -> str:
    """The commands that save a workspace's work, in the state it is in
    (export refuses uncommitted edits and patches still waiting)."""
    steps = []
    if any(line.startswith("uncommitted:") for line in lost):
        steps.append(
            f"commit the edits into a patch (`git -C {ws} add -A && git -C {ws} "
            f"commit -q --amend --no-edit` for the last one, `{layout.command} new "
            "NNNN-name.patch` for a new one)"
        )
    state = workspace.State.load(ws)
    if state is not None and (state.pending or state.stopped):
        steps.append(f"`{workspace.continue_hint(ws)}`")
    steps.append(f"`{layout.command} export`")
    return ", then ".join(steps)


def cmd_new(layout: Layout, args: argparse.Namespace) -> str:
    ws = (args.dir or layout.workspace).absolute()
    workspace.new_patch(ws, args.name)
    return (
        f"committed {args.name}: fill in its header with "
        f"`git -C {ws} commit --amend`, then `ci/overlay export --dir {ws}`"
    )


def cmd_export(layout: Layout, args: argparse.Namespace) -> str:
    ws = (args.dir or layout.workspace).absolute()
    names = workspace.export(ws, args.drop, args.force)
    state = workspace.State.load(ws)
    assert state is not None  # export refuses a workspace without its state
    series = state.export_to
    rebases = layout.build / "rebase"
    if Path(series).is_relative_to(rebases):
        version = Path(series).relative_to(rebases).parts[0]
        return (
            f"exported {len(names)} patches to {series}\n"
            f"next: `{layout.command} adopt {version}` (it says which checks "
            "must pass first)"
        )
    return (
        f"exported {len(names)} patches to {series}\n"
        f"next: review `git -C {layout.root} diff --stat -- {series}`, then "
        f"commit it with a message that says why: "
        f"`git -C {layout.root} add -A -- {series} && git -C {layout.root} commit`"
    )


def cmd_rebase_check(layout: Layout, args: argparse.Namespace) -> str:
    json_out = args.json or layout.build / "rebase" / "report.json"
    if args.wheel and not args.sdist:
        raise OverlayError("--wheel needs --sdist", "give the release's sdist too")
    local = None
    if args.sdist:
        local = (args.sdist.absolute(), args.wheel.absolute() if args.wheel else None)
    rebase.dry_run(layout, args.versions, json_out.absolute(), args.write, local)
    return f"report: {json_out}"


def cmd_adopt(layout: Layout, args: argparse.Namespace) -> str:
    # The checks run on exactly what goes in: the workspace, which must be
    # what rebased/patches holds.
    print(rebase.check_once(layout, args.version, args.python), file=sys.stderr)
    rebase_state.require_pass(layout, args.version)
    return adopt.adopt(layout, args.version)


def cmd_rebase_test(layout: Layout, args: argparse.Namespace) -> str:
    print(rebase.check_once(layout, args.version, args.python), file=sys.stderr)
    return gate.rebase_test(layout, args.version, args.tests)


def cmd_backport(layout: Layout, args: argparse.Namespace) -> str:
    if not layout.target:
        raise OverlayError(
            "backport carries a change of the main series to another target",
            "name the target: `ci/overlay --target NAME backport "
            f"{args.patch}` (targets/NAME/pin.toml)",
        )
    main = target_layout(layout.root, "")
    return backport.backport(main, layout, args.patch, args.rev)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ci/overlay", description=__doc__)
    parser.add_argument("--root", type=Path, help="checkout to work on")
    parser.add_argument(
        "--target",
        default="",
        metavar="NAME",
        help="work on targets/NAME/pin.toml and its series (default: pin.toml)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(
        name: str, func: Callable[[Layout, argparse.Namespace], str], help: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.set_defaults(func=func)
        return p

    add("check", cmd_check, "check the checkout's own files (no download, no tree)")
    add("build", cmd_build, "every step of ./build.sh").add_argument(
        "--mode", choices=build.MODES, default="assemble"
    )
    add("fetch-wheel", cmd_fetch_wheel, "download and verify the official wheel")
    add("apply", cmd_apply, "build/tree: fresh upstream + series + overlay")
    add("pristine-tree", cmd_pristine_tree, "the unpatched tree, for comparisons")
    add("manifest", cmd_manifest, "print the manifest a tree carries").add_argument(
        "tree", type=Path
    )
    add("image-args", cmd_image_args, "docker build arguments for Containerfile")
    p = add("publish", cmd_publish, "move a checked wheel into dist/")
    p.add_argument("wheel", type=Path)
    p.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="another wheel to publish in the same swap (the consumer wheel)",
    )
    p = add(
        "build-consumer",
        cmd_build_consumer,
        f"the {consumer_dist.DISTRIBUTION} wheel of a tree (main target)",
    )
    p.add_argument("tree", type=Path)
    p.add_argument("--wheel", type=Path, required=True, help="its engine wheel")
    add("lint", cmd_lint, "every check that needs no build (docs/testing.md)")
    add("patch-map", cmd_patch_map, "the series table of docs/architecture.md")
    p = add("workspace", cmd_workspace, "the series as git commits in build/workspace")
    p.add_argument("--upto", metavar="PATCH", help="stop after this patch")
    p.add_argument(
        "--force", action="store_true", help="discard the workspace's unsaved work"
    )
    p.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="commit the resolved patch, then apply the rest",
    )
    p.add_argument(
        "--skip", action="store_true", help="leave the stopped patch out, go on"
    )
    dir_help = "the workspace (default build/workspace)"
    p.add_argument("--dir", type=Path, help=dir_help)
    python_help = (
        "python with ruff that checks a rebase (default: a venv with only the "
        "ruff the tree's .pre-commit-config.yaml pins, .cache/ruff-env-*)"
    )
    p.add_argument("--python", type=Path, help=python_help)
    p = add("new", cmd_new, "commit workspace changes as a new patch")
    p.add_argument("name")
    p.add_argument("--dir", type=Path, help=dir_help)
    p = add("export", cmd_export, "write the workspace's commits to its series")
    p.add_argument("--dir", type=Path, help=dir_help)
    p.add_argument(
        "--drop",
        action="append",
        metavar="PATCH",
        help="let the export remove this patch of the series (repeatable)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite changes made to the series since the workspace was made",
    )
    p = add("rebase-check", cmd_rebase_check, "dry-run the series on other releases")
    p.add_argument("versions", nargs="+", metavar="VERSION")
    p.add_argument(
        "--json", type=Path, help="report path (default build/rebase/report.json)"
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="refresh the patches that apply, with a pin, per version",
    )
    p.add_argument(
        "--sdist",
        type=Path,
        help="the release's vLLM sdist from disk, not the index (one VERSION; "
        "a release candidate, a local build): docs/maintainers.md, recipe 5",
    )
    p.add_argument(
        "--wheel",
        type=Path,
        help="with --sdist: the pin's wheel project's wheel of that release",
    )
    p = add(
        "adopt",
        cmd_adopt,
        "check a finished rebase and put it in place of the target's series, "
        "pin and overlay",
    )
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--python", type=Path, help=python_help)
    p = add(
        "rebase-test",
        cmd_rebase_test,
        "build an exported rebase with its release's wheel and run the overlay's "
        "tests on it (adopt needs it to pass)",
    )
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--python", type=Path, help=python_help)
    p.add_argument(
        "--tests",
        nargs="+",
        metavar="FILE",
        help="only these test files (tests/...py); adopt does not accept such a run",
    )
    p = add(
        "backport",
        cmd_backport,
        "merge the change of a main-series patch into the target's workspace",
    )
    p.add_argument("patch", metavar="PATCH", help="its number (0002) or file name")
    p.add_argument(
        "--from",
        dest="rev",
        default="HEAD",
        metavar="REV",
        help="the commit holding the patch's old version (default HEAD)",
    )
    p = add("lint-upstream", cmd_lint_upstream, "ruff on patched upstream files")
    p.add_argument("tree", type=Path)
    p.add_argument(
        "--python",
        type=Path,
        help="python with ruff (default: a venv with only the ruff the tree's "
        ".pre-commit-config.yaml pins, .cache/ruff-env-*)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        # ci/overlay keeps SIGINT from raising during start-up (no
        # traceback); from here on it is a KeyboardInterrupt, one line.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        args = _parser().parse_args(argv)
        layout = (
            target_layout(args.root.resolve(), args.target)
            if args.root
            else default_layout(args.target)
        )
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
