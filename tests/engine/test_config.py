"""pipeline.yaml validation: each malformed file or --set gives one line naming the YAML path and the fix,
exit code 2, and nothing written."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stages.__main__ import main as main_plain
from stages.engine.config import own_names, pipeline_names, sweep_names
from stages.engine.errors import ConfigError
from stages.pipeline.loading import load_pipeline, load_sweep

ROOT = Path(__file__).resolve().parents[2]

BASE = """
defaults:
  train: {micro_batch_size: 1, gradient_accumulation_steps: 1, lr: 5.0e-5}
pipelines:
  bloom-imdb:
    model: {name: bigscience/bloom-560m}
    train: {gradient_accumulation_steps: 16}
"""


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main_plain(argv)
    err = capsys.readouterr().err
    return code, err


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pipeline.yaml"
    p.write_text(textwrap.dedent(text))
    return p


# nine anchors, each ten aliases of the one before: 10**9 values once expanded
BOMB = [f"&a [{','.join(['1'] * 10)}]"] + [f"&{c} [{','.join([f'*{p}'] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi",
                                                                                                 strict=True)]
CASES = [
    # (yaml body or None for BASE, --set list, pipeline, expected error line)
    (BASE.replace("gradient_accumulation_steps: 16", "gradient_accumulation_steps: 0"), [], "bloom-imdb",
     "pipelines.bloom-imdb.train.gradient_accumulation_steps: must be >= 1, got 0"),
    (BASE.replace("{gradient_accumulation_steps: 16}", "{gradient_accumulation_step: 16}"), [], "bloom-imdb",
     "pipelines.bloom-imdb.train.gradient_accumulation_step: unknown key 'gradient_accumulation_step'; valid keys here: "),
    (BASE.replace("micro_batch_size: 1,", "micro_batch_size: four,"), [], "bloom-imdb",
     "defaults.train.micro_batch_size: must be an integer, got 'four'"),
    (None, [], "bloom-imbd", "unknown pipeline 'bloom-imbd'; available: bloom-imdb"),
    (None, ["train.lr=-1"], "bloom-imdb", "--set train.lr: must be > 0, got -1"),
    (None, ["train.lrr=1e-4"], "bloom-imdb", "--set train.lrr: unknown key 'lrr'; valid keys here: micro_batch_size"),
    (None, ["train.lr"], "bloom-imdb", "--set train.lr: expected KEY=VALUE with a dotted key, e.g. --set train.lr=1e-4"),
    (None, ["train.optimizer=sgd"], "bloom-imdb",
     "--set train.optimizer: must be one of 'adam', 'adamw_torch', 'adamw_8bit' or 'paged_adamw_8bit', got 'sgd'"),
    (None, ["quantization.mode=2bit"], "bloom-imdb", "--set quantization.mode: must be one of 'none', '8bit' or '4bit'"),
    (BASE + "  broken: {extends: nope}\n", [], "broken", "pipelines.broken.extends: unknown pipeline 'nope'"),
    (BASE + "    model: [oops\n", [], "bloom-imdb", "pipeline.yaml line 9: not valid YAML"),
    (BASE + "    train: {lr: 1.0e-4}\n", [], "bloom-imdb", "pipeline.yaml line 8: not valid YAML (key 'train' appears twice"),
    (None, ["adapters.method=lora"], "bloom-imdb",
     "--set adapters: method 'lora' needs target_modules (e.g. [q_proj, v_proj])"),
    (None, ["data.split.mode=shuffle_concat"], "bloom-imdb",
     "--set data.split: shuffle_concat needs train, validation and test row counts"),
    (None, ["train.num_machines=2"], "bloom-imdb",
     "--set train: num_machines > 1 needs train.main_process_ip (machine 0's address, reachable from every machine)"),
    (None, ["train.machine_rank=2", "train.num_machines=2"], "bloom-imdb",
     "--set train: machine_rank 2 is not below num_machines 2: number the machines 0 .. 1"),
    # a name becomes a path (refs/<name>.json, sweeps/<name>/): a name that is a path of its own is refused
    (BASE + "  ../../evil: {extends: bloom-imdb}\n", [], "../../evil",
     "pipelines.../../evil.name: '../../evil' is not a name: use 1-128 letters, digits and _ . + = -"),
    (BASE + "  /tmp/evil: {extends: bloom-imdb}\n", [], "/tmp/evil", "'/tmp/evil' is not a name"),
    (BASE + "  x: {extends: x}\n", [], "x", "pipelines.x.extends: x extends itself, and pipeline.yaml has no "
     "pipeline x it could mean"),
    (BASE + "  x: {extends: y}\n  y: {extends: x}\n", [], "x", "pipelines.x.extends: cycle through ['x', 'y']"),
    # bounded input: aliases that expand a billionfold, in a free-form field, in the file or in --set
    (BASE + "    model: {from_config: {" + ", ".join(f"{n}: {v}" for n, v in zip("abcdefghi", BOMB, strict=True)) +
     "}}\n", [], "bloom-imdb", "pipeline.yaml: aliases (*name) expand to more than 100,000 values"),
    (None, [f"model.from_config=[{', '.join(BOMB)}]"], "bloom-imdb",
     "*h,*h]]: aliases (*name) expand to more than 100,000 values"),
]


@pytest.mark.parametrize("body,sets,pipeline,expected", CASES, ids=[c[3][:40] for c in CASES])
def test_malformed_config_is_one_line_exit_2_nothing_written(tmp_path, store_dir, capsys, body, sets, pipeline,
                                                              expected):
    path = write(tmp_path, body if body is not None else BASE)
    argv = [pipeline, "--config", str(path)] + [a for s in sets for a in ("--set", s)]
    code, err = run_cli(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert expected in lines[0], lines[0]
    assert not store_dir.exists()


@pytest.mark.parametrize("make,expected", [
    (lambda p: p.mkdir(), "a folder; --config takes a YAML pipeline file"),
    (lambda p: p.write_bytes(b"pipelines:\n  x: {}\n" + bytes(range(128, 256))), "line 3 is not UTF-8 text (byte 0x80)"),
    (lambda p: p.write_text("# padding\n" * 110_000), "larger than 1 MiB, not a pipeline file"),
    (lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
], ids=["folder", "binary", "huge", "device"])
def test_a_config_that_is_no_pipeline_file_is_one_line_nothing_read_past_a_limit(tmp_path, store_dir, capsys,
                                                                                   make, expected):
    make(tmp_path / "mine.yaml")
    code, err = run_cli(["x", "--config", str(tmp_path / "mine.yaml")], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / 'mine.yaml'}: {expected}"), err
    assert not store_dir.exists()


def test_unknown_stage_in_force_and_only(tmp_path, store_dir, capsys):
    path = write(tmp_path, BASE)
    for opt in ("--force", "--only"):
        code, err = run_cli(["bloom-imdb", "--config", str(path), opt, "trian"], capsys)
        assert code == 2 and f"{opt} trian: unknown stage (did you mean train?); stages are data, tokenize" in err
    assert not store_dir.exists()


def test_flow_entry_point_rejects_bad_set_before_prefect_starts(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "FINETUNE_STORE": str(tmp_path / "store"),
           "PREFECT_HOME": str(tmp_path / "prefect"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "flows.bloom_imdb", "--set", "train.gradient_accumulation_steps=0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --set train.gradient_accumulation_steps: must be >= 1, got 0")
    assert not (tmp_path / "store").exists() and not (tmp_path / "prefect").exists()


@pytest.mark.parametrize("setting, message", [
    ("train.epochs=1e9", "--set train.epochs: must be <= 10000, got 1000000000.0; for a run of a given length, "
                         "set train.max_steps (optimizer steps)"),
    ("train.micro_batch_size=1e20", "--set train.micro_batch_size: must be <= 65536, got 1e+20; for a larger "
                                    "effective batch, raise train.gradient_accumulation_steps"),
    ("train.micro_batch_size=100000000000000000000", "--set train.micro_batch_size: must be <= 65536, got "
                                                     "100000000000000000000; for a larger effective batch, raise "
                                                     "train.gradient_accumulation_steps"),
    ("train.micro_batch_size=0", "--set train.micro_batch_size: must be >= 1, got 0"),  # no fix for too small
    ("train.lr=.nan", "--set train.lr: must be a finite number, got nan"),
    ("train.lr=nan", "--set train.lr: must be a finite number, got 'nan'"),
    ("train.epochs=.inf", "--set train.epochs: must be a finite number, got inf"),
], ids=["epochs", "micro-batch", "micro-batch-past-int64", "micro-batch-0", "lr-nan", "lr-nan-word", "epochs-inf"])
def test_absurd_sizes_and_non_finite_numbers_are_one_line_that_says_the_fix(tmp_path, store_dir, capsys, setting,
                                                                             message):
    code, err = run_cli(["tiny-imdb", "--set", setting], capsys)
    assert code == 2 and err == f"error: {message}\n"
    assert not store_dir.exists()


def test_the_largest_allowed_sizes_still_load():
    cfg = load_pipeline("tiny-imdb", ["train.epochs=10000", "train.micro_batch_size=65536"])
    assert cfg.train.epochs == 10_000 and cfg.train.micro_batch_size == 65_536


def test_shipped_pipelines_validate_with_article_settings():
    names = pipeline_names()
    for required in ("bloom-imdb", "bloom-imdb-no-accum", "qlora-t5-billsum", "demo", "tiny-imdb", "tiny-billsum"):
        assert required in names
    for name in names:
        load_pipeline(name)
    bloom = load_pipeline("bloom-imdb")
    assert (bloom.model.name, bloom.model.num_labels, bloom.adapters.method) == ("bigscience/bloom-560m", 2, "full")
    assert (bloom.train.micro_batch_size, bloom.train.gradient_accumulation_steps) == (1, 16)
    assert (bloom.train.optimizer, bloom.train.lr, bloom.train.epochs, bloom.train.seed) == ("adam", 5e-5, 1, 123)
    sp = bloom.data.split
    assert (sp.mode, sp.seed, sp.train, sp.validation, sp.test) == ("shuffle_concat", 1, 35000, 5000, 10000)
    assert bloom.tokenize.max_length == 1024
    assert load_pipeline("bloom-imdb-no-accum").train.gradient_accumulation_steps == 1
    t5 = load_pipeline("qlora-t5-billsum")
    q, a, t = t5.quantization, t5.adapters, t5.train
    assert (t5.model.name, q.mode, q.quant_type, q.double_quant) == ("t5-3b", "4bit", "nf4", True)
    assert (a.method, a.r, a.alpha, a.dropout, a.target_modules, a.modules_to_save) == (
        "lora", 32, 16, 0.05, ["v", "o"], ["lm_head"])
    assert (t5.tokenize.prefix, t5.tokenize.max_length, t5.tokenize.max_target_length) == ("summarize: ", 1024, 128)
    assert (t.optimizer, t.micro_batch_size, t.lr, t.weight_decay, t.epochs) == ("paged_adamw_8bit", 4, 2e-5, 0.01, 4)


def test_set_overrides_apply_and_parse_yaml_values():
    cfg = load_pipeline("bloom-imdb", ["train.lr=1e-4", "evaluate.splits=[test]", "data.subset={train: 8}"])
    assert cfg.train.lr == 1e-4 and cfg.evaluate.splits == ["test"] and cfg.data.subset == {"train": 8}
    assert load_pipeline("bloom-imdb", {"train.lr": "2e-4"}).train.lr == 2e-4  # deployment-style dict


# ---------------------------------------------------------------- a user's own file


USER = """
defaults:
  train: {weight_decay: 0.01, lr: 2.0e-3}
pipelines:
  demo:                       # the project's demo, extended under its own name
    extends: demo
    data: {source: local, path: data/reviews.csv, label_column: sentiment, split: {mode: source, validation: 2}}
    tokenize: {tokenizer: ./tok}
    train: {accelerate_config: acc.yaml, mixed_precision: no}
    evaluate: {metrics: [accuracy, metrics/my_metric.py]}
  mine:
    extends: tiny-imdb        # a project pipeline the file does not define
    train: {mixed_precision: off}
"""


def user_file(tmp_path: Path) -> Path:
    folder = tmp_path / "project-of-mine"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "reviews.csv").write_text("text,sentiment\na,x\nb,y\nc,x\nd,y\n")
    (folder / "tok").mkdir()
    (folder / "metrics").mkdir()
    (folder / "metrics" / "my_metric.py").write_text("# a local evaluate module\n")
    path = folder / "mine.yaml"
    path.write_text(textwrap.dedent(USER))
    return path


def test_a_user_file_extends_the_projects_pipelines_and_defaults(tmp_path, monkeypatch):
    path = user_file(tmp_path)
    monkeypatch.chdir(tmp_path)  # relative paths mean the file's folder, not the current directory
    demo = load_pipeline("demo", [], path)
    project = load_pipeline("demo")
    folder = path.parent.resolve()
    assert demo.model == project.model and demo.adapters == project.adapters  # from the project's demo
    assert demo.train.eval_every == project.train.eval_every == 16
    assert demo.train.lr == project.train.lr == 1e-3  # a project pipeline's value wins over the user's defaults
    assert demo.train.weight_decay == 0.01  # which apply over the project's defaults
    assert demo.data.mirror == str((ROOT / ".." / "shared" / "data").resolve())  # a project default, at the project's folder
    assert demo.data.path == str(folder / "data" / "reviews.csv")
    assert demo.tokenize.tokenizer == str(folder / "tok")
    assert demo.train.accelerate_config == str(folder / "acc.yaml")
    assert demo.evaluate.metrics == ["accuracy", str(folder / "metrics" / "my_metric.py")]
    assert demo.train.mixed_precision == "no"  # YAML's `no` (a boolean) is the choice's word
    mine = load_pipeline("mine", [], path)
    assert mine.model == load_pipeline("tiny-imdb").model and mine.train.weight_decay == 0.01
    assert mine.train.mixed_precision == "no"  # `off` too
    assert {"demo", "mine", "tiny-imdb", "bloom-imdb"} <= set(pipeline_names(path))
    # a --set path is the shell's: relative to the current directory, made absolute when loaded
    assert load_pipeline("demo", ["data.path=x.csv"], path).data.path == str(Path.cwd() / "x.csv")


def test_a_user_file_error_names_the_file_it_comes_from(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("pipelines:\n  mine:\n    extends: nope\n  other:\n    extends: demo\n    train: {lr: 2}\n")
    with pytest.raises(ConfigError, match=r"^pipelines.mine.extends: unknown pipeline 'nope'; available: "):
        load_pipeline("mine", [], path)
    with pytest.raises(ConfigError, match=r"^pipelines.other.train.lr: must be < 1, got 2$"):
        load_pipeline("other", [], path)
    path.write_text("defaults:\n  train: {weight_decay: -1}\npipelines:\n  other:\n    extends: demo\n")
    with pytest.raises(ConfigError, match=r"^defaults.train.weight_decay: must be >= 0, got -1$"):
        load_pipeline("other", [], path)
    path.write_text("defaults:\n  train: {optimizer: sgd}\npipelines:\n  other:\n    extends: tiny-imdb\n")
    with pytest.raises(ConfigError, match=r"^defaults.train.optimizer: must be one of"):
        load_pipeline("other", [], path)


def test_a_user_file_of_sweeps_or_defaults_alone_builds_on_the_projects_pipelines(tmp_path, store_dir, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text("sweeps:\n  my-lrs:\n    pipeline: tiny-imdb\n    grid: {train.lr: [1.0e-3, 1.0e-2]}\n")
    assert own_names(path) == ["my-lrs"] and "tiny-imdb" in pipeline_names(path)
    assert {"my-lrs", *sweep_names()} == set(sweep_names(path))
    assert load_sweep("my-lrs", path).grid == {"train.lr": [1e-3, 1e-2]}
    path.write_text("defaults:\n  train: {weight_decay: 0.02}\n")
    assert own_names(path) == [] and pipeline_names(path) == pipeline_names()
    assert load_pipeline("tiny-imdb", [], path).train.weight_decay == 0.02
    assert load_pipeline("tiny-imdb").train.weight_decay == 0.0
    path.write_text("defaults:\n  train: {optimizer: sgd}\n")  # read by the command: the project's pipeline fails
    code, err = run_cli(["tiny-imdb", "--config", str(path)], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "error: defaults.train.optimizer: must be one of 'adam', 'adamw_torch', 'adamw_8bit' or 'paged_adamw_8bit', "
        "got 'sgd'"], err
    for text in ("", "# nothing yet\n", "pipelines:\n", "defaults: {}\nsweeps:\n", "- a list\n"):
        path.write_text(text)
        code, err = run_cli(["tiny-imdb", "--config", str(path)], capsys)
        assert code == 2 and err.strip().splitlines() == [
            "error: mine.yaml: holds no pipelines:, sweeps: or defaults: mapping; give at least one (a file of "
            "yours builds on the project's pipeline.yaml)"], (text, err)
    path.write_text("pipelines: [demo]\n")
    code, err = run_cli(["tiny-imdb", "--config", str(path)], capsys)
    assert code == 2 and err.strip() == "error: mine.yaml: pipelines must be a mapping of named pipelines", err
    assert not store_dir.exists()


@pytest.mark.parametrize("word,field,expected", [("no", "train.mixed_precision", "no"),
                                                 ("off", "train.mixed_precision", "no"),
                                                 ("false", "quantization.mode", "none"),
                                                 ("no", "adapters.bias", "none")])
def test_yaml_booleans_in_a_choice_field_mean_the_word(word, field, expected):
    cfg = load_pipeline("tiny-imdb", [f"{field}={word}"])
    section, key = field.split(".")
    assert getattr(getattr(cfg, section), key) == expected


def test_a_boolean_no_choice_means_gets_a_one_line_fix(tmp_path, store_dir, capsys):
    code, err = run_cli(["tiny-imdb", "--set", "train.optimizer=yes"], capsys)
    assert code == 2 and err.strip() == (
        "error: --set train.optimizer: must be one of 'adam', 'adamw_torch', 'adamw_8bit' or 'paged_adamw_8bit', "
        "got True (YAML reads yes/no/on/off/true/false as a boolean; quote the word)")
    assert not store_dir.exists()
