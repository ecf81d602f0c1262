"""Every `bash`, `console` and `python` block of README.md, README.zh-CN.md, docs/*.md and docs/zh-CN/*.md runs.

How (tests/docs/docblocks.py finds and marks the blocks, docrun.py runs them):
- one fresh temporary directory per page, with `examples/` linked in and the few inputs the docs
  assume the reader has (FIXTURES: `train.py`, `mypkg/train.py`, text files); blocks in
  document order, each bounded by BLOCK_TIMEOUT;
- one rule bounds the cost: a `meshrun train` that does not use examples/configs/tiny.toml gets
  `--set train.steps=2 --set train.eval_steps=2` (STEPS_CAP) appended; everything else runs as written;
- `<!-- doc-test: skip (reason) -->` before a fence exempts it, with its reason beside it;
  `<!-- doc-test: fails -->` makes a console block's commands required to fail, with the output shown;
- a block already run, after the same blocks, on an earlier page (up to comments) is not run
  again: its outcome and the files it left are reused (docrun.Memo). The two READMEs (see
  test_readme_parity.py) run once, and so does a docs/zh-CN/ page's copy of its English page's blocks
  (test_zh_docs.py); docs/checkpoint.md and docs/metrics.md share their first run;
- two pages run at a time (docrun.run_pages), each alone in its directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import child_env
from docblocks import REPO, RUN_LANGS, Block, PageError, normalized, parse
from docrun import Memo, failure_report, run_page, run_pages

PAGES = [REPO / "README.md", REPO / "README.zh-CN.md", *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "docs" / "zh-CN").glob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.fixture(scope="module")
def page_outcomes(request, tmp_path_factory) -> dict[Path, list]:
    """Every page selected in this session, run once, two pages at a time (docrun.run_pages)."""
    selected = [item.callspec.params["page"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_page_blocks_run"]
    root = tmp_path_factory.mktemp("doc-pages")
    return run_pages(selected, root, child_env(), Memo(root / "snapshots"))


@pytest.mark.timeout(1800)  # the first page's test also runs the others: bounded per block by BLOCK_TIMEOUT
@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_page_blocks_run(page: Path, page_outcomes: dict[Path, list]):
    outcomes = page_outcomes[page]
    for o in outcomes:  # shown with -s or on failure: what each block cost
        print(f"{o.block.where}: {'reused' if o.reused else f'{o.seconds:.1f}s'}")
    assert all(o.ok for o in outcomes), f"{_rel(page)}: a documented command or snippet broke\n{failure_report(outcomes)}"


def test_every_fence_names_its_language():
    """An untagged fence would dodge the runner: commands are tagged bash/console/python, the rest text/toml/json."""
    untagged = [b.where for page in PAGES for b in parse(page) if not b.lang]
    assert not untagged, f"fences without a language (use bash/console/python to run, text otherwise): {untagged}"


def exempt_blocks() -> list[Block]:
    return [b for page in PAGES for b in parse(page) if b.lang in RUN_LANGS and b.marker == "skip"]


def test_exempt_list_is_short():
    """Keep exemptions rare: each one is a command nobody checks. Raise the bound only with a reason."""
    exempt = {(b.lang, normalized(b)): b for b in exempt_blocks()}.values()  # the READMEs' count once
    # 12: docs/generate.md's overview needs a trained run and an HF export of it (the commands run
    # in docs/checkpoint.md's "Export to Hugging Face" and tests/e2e/test_generate.py instead).
    # 13: docs/cluster.md's SLURM commands need a SLURM cluster (tests/e2e/test_submit_slurm_jobs.py runs them
    # on a one-node SLURM it starts).
    # 15: docs/cluster.md's Ray runs, on a remote cluster and on a local Ray instance (90 s of the docs
    # run): tests/e2e/test_submit_ray_jobs.py runs the same job on a two-node local cluster it starts.
    assert len(exempt) <= 15, "\n".join(f"{b.where}: {b.reason}" for b in exempt)


# --- the harness itself must fail on a broken page: scratch pages, one short subprocess each ---

def _scratch(tmp_path: Path, body: str) -> list:
    tmp_path.mkdir(parents=True, exist_ok=True)
    page = tmp_path / "scratch.md"
    page.write_text(body, encoding="utf-8")
    return run_page(page, tmp_path / "work", child_env())


def _page_with(name: str, old: str, typo: str) -> str:
    """A scratch copy of docs/NAME with one typo in it (pages whose blocks take a second)."""
    text = (REPO / "docs" / name).read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    return text.replace(old, typo)


def test_typo_in_a_command_fails_the_page(tmp_path: Path):
    outcomes = _scratch(tmp_path, _page_with("config.md", "```bash\nmeshrun config show", "```bash\nmeshrun config shwo"))
    assert [o.ok for o in outcomes] == [False], failure_report(outcomes)
    assert "invalid choice: 'shwo'" in outcomes[0].detail and outcomes[0].block.lang == "bash"


def test_typo_in_a_snippet_fails_the_page(tmp_path: Path):
    outcomes = _scratch(tmp_path, _page_with("models.md", "    return MyModel(vocab_size)", "    retrun MyModel(vocab_size)"))
    assert [o.ok for o in outcomes] == [False], failure_report(outcomes)
    assert outcomes[0].block.lang == "python" and "SyntaxError" in outcomes[0].detail


def test_an_error_example_must_fail_with_its_output(tmp_path: Path):
    shown = "meshrun config: error: unknown key 'optim.lrr' in --set optim.lrr=1e-3; did you mean 'optim.lr'?"
    page = ("<!-- doc-test: fails -->\n```console\n$ meshrun config show --set optim.lrr=1e-3\n" + shown + "\n```\n\n"
            "<!-- doc-test: fails -->\n```console\n$ meshrun config show --set optim.lr=1e-3\n```\n")
    outcomes = _scratch(tmp_path, page)
    # the first fails as shown; the second exits 0, which a `fails` block does not allow
    assert [o.ok for o in outcomes] == [True, False], failure_report(outcomes)
    assert "expected a non-zero exit" in outcomes[1].detail


def test_output_a_console_block_shows_must_be_printed(tmp_path: Path):
    page = "```console\n$ meshrun config show examples/configs/tiny.toml\n[train] ...\nsteps = {} ...\n```\n"
    assert [o.ok for o in _scratch(tmp_path / "right", page.format(20))] == [True]
    outcomes = _scratch(tmp_path / "wrong", page.format(21))
    assert [o.ok for o in outcomes] == [False] and "lacks the shown line 'steps = 21 ...'" in outcomes[0].detail


def test_the_readmes_run_as_in_a_new_shell_where_only_activation_finds_meshrun(tmp_path: Path):
    """A README runs with a PATH without the venv, as a new shell has it: its commands fail unless the
    page activates the venv first, and what a block exports (activation) holds for the blocks after it."""
    command = "```console\n$ meshrun --version\nmeshrun ...\n```\n"
    activate = "```bash\nsource .venv/bin/activate\n```\n\n"
    outcomes = {}
    for name, body in (("bare", command), ("activated", activate + command)):
        (tmp_path / name).mkdir()
        page = tmp_path / name / "README.md"
        page.write_text(body, encoding="utf-8")
        outcomes[name] = run_page(page, tmp_path / name / "work", child_env())
    assert [o.ok for o in outcomes["activated"]] == [True, True], failure_report(outcomes["activated"])
    assert [o.ok for o in outcomes["bare"]] == [False], failure_report(outcomes["bare"])
    assert "meshrun: command not found" in outcomes["bare"][0].detail, outcomes["bare"][0].detail


@pytest.mark.parametrize("page", [
    "<!-- doc-test: skip -->\n```bash\nls\n```\n",                       # a skip without its reason
    "<!-- doc-test: skip (why) -->\nprose\n```bash\nls\n```\n",         # not right before the fence
    "<!-- doc-test: fails -->\n```bash\nfalse\n```\n",                 # fails: console only (output shown)
    "<!-- doc-test: skip (why) -->\n",                                   # no fence after it
    "```bash\nls\n",                                                    # never closed
])
def test_a_malformed_marker_or_fence_is_refused(page: str, tmp_path: Path):
    path = tmp_path / "bad.md"
    path.write_text(page, encoding="utf-8")
    with pytest.raises(PageError):
        parse(path)
