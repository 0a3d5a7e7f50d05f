"""Every command the README shows is one that CI or a test runs, and the README stays short.

Each command of the README's ```bash blocks (comments stripped) must be in RUN_BY, which says where
it runs: a file and the text there that runs it. The test fails on a README command nobody runs, on
a runner that no longer holds that text, and on a runner whose text lacks a word of the command (its
program and subcommand, every option). `bash scripts/main.sh` as a whole is not in CI (its every
family check takes longer than CI's budget); each of its steps is, and RUN_BY lists both sides.
"""

from __future__ import annotations

import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: README command -> where it runs: (file, the text in it that runs the command).
RUN_BY: dict[str, list[tuple[str, str]]] = {
    # scripts/test.sh's run_wheel_install, in a clean copy of the checkout (the wheel row).
    "pip install .": [("scripts/test.sh", "-m pip install --quiet --disable-pip-version-check .)")],
    "pip wheel . --no-deps -w dist": [
        ("scripts/test.sh", "-m pip wheel . --no-deps --quiet --disable-pip-version-check -w dist)")],
    "pip install dist/vllm_sinks-*.whl": [
        ("scripts/test.sh", "-m pip install --quiet --disable-pip-version-check dist/vllm_sinks-*.whl)")],
    "vllm-sinks report": [("scripts/test.sh", '"$venv/bin/vllm-sinks" report'),
                          ("scripts/test.sh", '"$dir/venv/bin/vllm-sinks" report')],
    # The command line on a bad path; the same check end to end on tiny checkpoints in that file.
    "vllm-sinks verify --model /path/to/checkpoint": [
        ("tests/vllm/test_verify_model_e2e.py", 'cli.main(["verify", "--model", ')],
    "python -m vllm.entrypoints.openai.api_server --model /path/to/checkpoint --model-impl transformers": [
        ("tests/support/server.py", '"-m", "vllm.entrypoints.openai.api_server", "--model"'),
        ("tests/support/server.py", '"--model-impl", impl')],
    "bash scripts/main.sh": [
        ("scripts/main.sh", '"$repo/scripts/venv.sh" "${VLLM_VERSION:-0.29.0}"'),
        ("scripts/test.sh", 'scripts/venv.sh "$name"'),
        ("scripts/main.sh", '"$venv/bin/vllm-sinks" report'), ("scripts/test.sh", '"$venv/bin/vllm-sinks" report'),
        ("scripts/main.sh", 'exec "$venv/bin/vllm-sinks" verify "$@"'),
        ("scripts/test.sh", '"$venv/bin/vllm-sinks" verify')],
    "bash scripts/test.sh": [(".ci/run", "exec bash scripts/test.sh")],
}


#: A program as a runner may call it: `vllm-sinks` is the console script of `vllm_sinks.cli:main`.
SPELLINGS = {"vllm-sinks": ("vllm-sinks", "cli.main(")}


def readme_commands(text: str) -> list[str]:
    """Each command line of the ```bash blocks, its comment stripped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].split(" # ", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def key_words(command: str) -> list[str]:
    """What a runner must say too: program and subcommand (a module for `python -m`), every option."""
    words = shlex.split(command)
    if words[:2] == ["python", "-m"]:
        words = words[2:]
    head = [w for w in words[:2] if not w.startswith("-") and w not in ("bash", ".")]
    return head + [w for w in words if w.startswith("-")]


def test_every_readme_command_is_run_by_ci_or_a_test():
    commands = readme_commands(README.read_text())
    assert commands, "no ```bash blocks found in the README"
    unrun = [c for c in commands if c not in RUN_BY]
    assert not unrun, f"README commands that nothing runs (add the runner to RUN_BY): {unrun}"
    stale = [c for c in RUN_BY if c not in commands]
    assert not stale, f"RUN_BY names commands the README no longer shows: {stale}"


def test_each_runner_still_runs_its_command():
    for command, runners in RUN_BY.items():
        texts = []
        for path, text in runners:
            assert text in (ROOT / path).read_text(), f"{path} no longer runs `{command}` ({text!r})"
            texts.append(f"{path} {text}")
        missing = [w for w in key_words(command)
                   if not any(s in t for s in SPELLINGS.get(w, (w,)) for t in texts)]
        assert not missing, f"the runners of `{command}` do not say {missing}"


def test_the_console_script_is_the_cli_main():
    assert 'vllm-sinks = "vllm_sinks.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_main_sh_builds_a_row_of_the_matrix():
    rows = [line.split()[0] for line in (ROOT / "scripts" / "matrix.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert "0.29.0" in rows


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 110, "the README is read top to bottom: keep detail in docs/"


def test_the_extraction_sees_commands_and_not_comments():
    text = "x\n```bash\npip install .   # beside vLLM\n# only a comment\n\nvllm-sinks report\n```\n"
    assert readme_commands(text) == ["pip install .", "vllm-sinks report"]
    assert key_words("python -m vllm.entrypoints.openai.api_server --model M --model-impl t") == \
        ["vllm.entrypoints.openai.api_server", "--model", "--model-impl"]
