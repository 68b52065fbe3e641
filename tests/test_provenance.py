"""The command line a benchmark records names no machine's directories."""

from ddtree_jax.experiments.provenance import command_line


def test_program_under_the_working_directory_is_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "experiments" / "bench_models.py"
    assert command_line([str(script), "--batches", "1"]) == "experiments/bench_models.py --batches 1"


def test_program_elsewhere_is_its_file_name(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert command_line([str(tmp_path / "venv" / "bin" / "ddtree"), "bench"]) == "ddtree bench"


def test_default_is_sys_argv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [str(tmp_path / "ddtree_jax" / "cli.py"), "sweep", "--quick"])
    assert command_line() == "ddtree_jax/cli.py sweep --quick"
