"""scripts/demo.sh, the README's main job, wired end to end: it runs its own Python for the asset path and hands
`delta-attention convert` and the demo options that their parsers accept (the heavy commands are recorded, not run)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from delta_attention.scripts import convert as convert_script
from delta_attention.scripts import demo as demo_script
from delta_attention.scripts.cli import parse_options

ROOT = Path(__file__).resolve().parents[1]


def fake_environment(folder: Path, log: Path) -> Path:
    """A venv stand-in: `delta-attention` and `python -m` record their arguments; `python -c` is the real Python."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "delta-attention").write_text(f'#!/usr/bin/env bash\necho "delta-attention $*" >> {shlex.quote(str(log))}\n')
    (bin_dir / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = "-m" ]; then echo "python $*" >> {shlex.quote(str(log))}; exit 0; fi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n')
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    return folder


def test_the_demo_script_converts_the_offline_gguf_and_runs_the_demo_on_it(tmp_path, smollm2_gguf):
    log = tmp_path / "calls.txt"
    env = {**os.environ, "DELTA_ATTENTION_VENV": str(fake_environment(tmp_path / "venv", log))}
    out = tmp_path / "demo-model"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [call[:2] for call in calls] == [["delta-attention", "assets"], ["delta-attention", "convert"],
                                            ["python", "-m"]]

    options, settings = parse_options(convert_script.Options, calls[1][2:], "delta-attention convert")
    assert Path(options.source) == Path(smollm2_gguf) and Path(options.out) == out and options.overwrite
    assert settings.keep_attention == "auto:0.25" and settings.init == "calibrated"
    assert settings.attention_window == 1024  # the constant-memory layout: the kept softmax layers slide

    assert calls[2][2] == "delta_attention.scripts.demo"
    (demo,) = parse_options(demo_script.Options, calls[2][3:], "demo")
    assert Path(demo.converted) == out
