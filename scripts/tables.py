"""A paper's table as data (`tables/*.yaml`, read by `scripts/reproduce.py`): one file per table, one schema.

    title: PaCo supplementary, Table 9 -- ImageNet-LT, top-1 (%) by shot group
    kind: paper              # optional: paper (the default) or baselines, what its rows' sources are
    stand_in: ...            # only in a Digits-M stand-in table: the paper's table it stands in for
    not_covered:             # rows of the paper's table that no config here reproduces, and why
      - {label: "ResNeXt-101, Balanced Softmax", reason: "no config states its recipe"}
    rows:
      - id: r50-paco                                  # unique in the file: the run directory and the --rows name
        label: ResNet-50, PaCo                        # as printed in the paper
        pretrain:
          config: configs/paco_imagenet_lt.yaml       # relative to the repository root
          overrides: {model.init_args.temperature: 0.2}   # optional: `--key=value` after the config
        evaluation: {longtail: test}                  # or a list of evaluations, see below
        paper: {many: 65.0, medium: 55.7, few: 38.2, all: 57.0}   # metric -> the paper's number in %
        source: PaCo supplementary, Table 9
        seeds: 1                                      # seeds 0 .. seeds-1
        note: ...                                     # optional: what the reader of the table must know

Evaluations and the metrics they give (in %):
- `knn`: `knn`, the kNN monitor's top-1 at the end of pretraining (`val/knn_top1` of `results_val.json`);
- `probe`: `probe`, the online linear probe's top-1 at the end of pretraining (`val/probe_top1`);
- `{linear: CONFIG, overrides: {...}}`: `linear`, the top-1 of the linear stage `main_linear.py fit --config CONFIG`
  on the run's `last.ckpt`, run in `<run>/linear` (its `val/probe_top1`);
- `{longtail: val}`: `many`, `medium`, `few`, `all`, a long-tail classifier's top-1 per shot group and over all
  images at the end of pretraining (`val/many_top1`, `val/medium_top1`, `val/few_top1`, `val/top1`);
- `{longtail: test, overrides: {...}}`: the same from `main_pretrain.py test` on the run's `last.ckpt`, run in
  `<run>/test` (the `test/` keys of its `results_test.json`);
- `representation`: `uniformity` (-L_uniformity) and `tolerance` of the validation embeddings at the end of
  pretraining (`val/uniformity`, `val/tolerance`, logged by a config's `analysis.RepresentationAnalysis`), not in %.
`paper` names some of the row's metrics (their numbers in the paper's units): every row of a paper's table gives at least one number; a stand-in
table's rows may give none (`null`), and there its numbers are the stood-in table's, for orientation only.
`load_table` checks a file against this schema; the first problem is one ValueError naming the file and the row.

What a row's `source` names follows the table's `kind`: in a paper's table (`kind: paper`, the default) the paper's
supplement and its table ("PaCo supplementary, Table 9"); in a baselines' table (`kind: baselines`: the numbers a
baseline's own repository or a library of baselines reports, not a paper's table) the repository, its README and the
commit read as `owner/name [path/]README[.md] at <commit>` ("vturrisi/solo-learn README at 9187ea3, table
CIFAR-10"). A stand-in table's sources are free text (its numbers are the stood-in table's, for orientation).
tests/test_reproduce.py holds every shipped table file to this.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROW_KEYS = ("id", "label", "pretrain", "evaluation", "paper", "source", "seeds")  # each required
OPTIONAL_ROW_KEYS = ("note",)
TABLE_KEYS = ("title", "kind", "stand_in", "not_covered", "rows")
MAX_SEEDS = 100  # a row's seeds: more is a typo (each seed is one training run)
KINDS = ("paper", "baselines")  # what the rows' sources are: a paper's supplement table, a repository's README
ROW_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SHOT_GROUPS = {"many": "many_top1", "medium": "medium_top1", "few": "few_top1", "all": "top1"}


@dataclass(frozen=True)
class Metric:
    name: str
    stage: str  # "" for the pretraining run's directory, else its subdirectory ("linear", "test")
    results: str  # the results file of that stage
    key: str
    percent: bool = True  # an accuracy, shown x100


@dataclass(frozen=True)
class Evaluation:
    kind: str  # knn, probe, linear, longtail or representation
    config: str | None = None  # linear: the linear-stage config
    split: str = "val"  # longtail: val (the end of pretraining) or test (a test run)
    overrides: tuple[str, ...] = ()

    @property
    def stage(self) -> str | None:
        """The run's subdirectory of this evaluation's own run; None when it reads the pretraining's results."""
        return "linear" if self.kind == "linear" else "test" if self.kind == "longtail" and self.split == "test" else None

    @property
    def metrics(self) -> list[Metric]:
        if self.kind in ("knn", "probe"):
            return [Metric(self.kind, "", "results_val.json", f"val/{self.kind}_top1")]
        if self.kind == "linear":
            return [Metric("linear", "linear", "results_val.json", "val/probe_top1")]
        if self.kind == "representation":
            return [Metric(name, "", "results_val.json", f"val/{name}", percent=False) for name in ("uniformity", "tolerance")]
        stage, results = (self.stage or "", f"results_{self.split}.json")
        return [Metric(name, stage, results, f"{self.split}/{key}") for name, key in SHOT_GROUPS.items()]


@dataclass(frozen=True, eq=False)  # a row is itself (its paper numbers are a dict)
class Row:
    id: str
    label: str
    config: str
    overrides: tuple[str, ...]  # `--key=value` of the pretraining
    evaluations: tuple[Evaluation, ...]
    paper: dict[str, float | None]  # metric name -> the paper's number (%)
    source: str
    seeds: int
    note: str | None = None

    @property
    def metrics(self) -> list[Metric]:
        return [metric for evaluation in self.evaluations for metric in evaluation.metrics]


@dataclass(frozen=True)
class Table:
    path: Path
    title: str
    kind: str  # paper or baselines
    stand_in: str | None
    not_covered: tuple[tuple[str, str], ...]  # (label, reason)
    rows: tuple[Row, ...]


def override_arguments(overrides, where: str) -> tuple[str, ...]:
    """`{key: value}` as CLI overrides `--key=value`, the value written as YAML (what the CLI parses)."""
    if overrides is None:
        return ()
    if not isinstance(overrides, dict):
        raise ValueError(f"{where} is not a mapping of config keys to values")
    return tuple(f"--{key}={as_yaml(value)}" for key, value in overrides.items())


def as_yaml(value) -> str:
    if isinstance(value, str):
        return value
    # flow style on one line; a bare scalar ends with YAML's document end marker
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=float("inf")).removesuffix("\n").removesuffix("\n...")


def existing_config(path, where: str) -> str:
    if not isinstance(path, str) or not (ROOT / path).is_file():
        raise ValueError(f"{where} {path!r} is not a config of this repository (a path from its root)")
    return path


def parse_evaluation(entry) -> Evaluation:
    if entry in ("knn", "probe", "representation"):
        return Evaluation(entry)
    if isinstance(entry, dict) and "linear" in entry and set(entry) <= {"linear", "overrides"}:
        config = existing_config(entry["linear"], "its linear-stage config")
        return Evaluation("linear", config=config, overrides=override_arguments(entry.get("overrides"), "its linear overrides"))
    if isinstance(entry, dict) and entry.get("longtail") in ("val", "test") and set(entry) <= {"longtail", "overrides"}:
        if entry["longtail"] == "val" and entry.get("overrides"):
            raise ValueError("its evaluation {longtail: val} reads the pretraining's results and takes no overrides")
        overrides = override_arguments(entry.get("overrides"), "its test overrides")
        return Evaluation("longtail", split=entry["longtail"], overrides=overrides)
    raise ValueError(f"its evaluation {entry!r} is none of knn, probe, representation, {{linear: CONFIG, overrides: ...}}, "
                     "{longtail: val} or {longtail: test, overrides: ...}")


def parse_row(entry, stand_in: bool) -> Row:
    if not isinstance(entry, dict):
        raise ValueError("is not a mapping")
    if unknown := set(entry) - set(ROW_KEYS) - set(OPTIONAL_ROW_KEYS):
        raise ValueError(f"has unknown keys {sorted(unknown)} (a row has {', '.join(ROW_KEYS + OPTIONAL_ROW_KEYS)})")
    if missing := [key for key in ROW_KEYS if entry.get(key) in (None, "")]:
        raise ValueError("has no " + ", no ".join(missing))
    if not isinstance(entry["id"], str) or not ROW_ID.fullmatch(entry["id"]):
        raise ValueError(f"id {entry['id']!r} is not a name of letters, digits, '.', '_' and '-'")
    for key in ("label", "source", "note"):
        if key in entry and not isinstance(entry[key], str):
            raise ValueError(f"its {key} {entry[key]!r} is not text")
    pretrain = entry["pretrain"]
    if not isinstance(pretrain, dict) or "config" not in pretrain or not set(pretrain) <= {"config", "overrides"}:
        raise ValueError("its pretrain is not a mapping of config and (optional) overrides")
    config = existing_config(pretrain["config"], "its pretraining config")
    overrides = override_arguments(pretrain.get("overrides"), "its pretraining overrides")
    evaluations = tuple(map(parse_evaluation, entry["evaluation"] if isinstance(entry["evaluation"], list) else [entry["evaluation"]]))
    names = [metric.name for evaluation in evaluations for metric in evaluation.metrics]
    if len(set(names)) < len(names):
        raise ValueError(f"its evaluations give a metric twice ({', '.join(names)})")
    paper = entry["paper"]
    if not isinstance(paper, dict) or not set(paper) <= set(names):
        raise ValueError(f"its paper {paper!r} is not a mapping of its metrics ({', '.join(names)}) to numbers")
    for name, number in paper.items():
        if number is not None and (isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number)):
            raise ValueError(f"its paper number for {name} ({number!r}) is not a finite number")
    if not stand_in and all(number is None for number in paper.values()):
        raise ValueError("gives no paper number (only a stand-in table's rows may have none)")
    seeds = entry["seeds"]
    if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= MAX_SEEDS:
        raise ValueError(f"its seeds {seeds!r} is not a number of seeds from 1 to {MAX_SEEDS}")
    return Row(entry["id"], entry["label"], config, overrides, evaluations, dict(paper), entry["source"], seeds, entry.get("note"))


def load_table(path: Path) -> Table:
    """The table file at `path`, checked; ValueError `<file>: row <n> (<id>): <problem>` at its first problem."""
    shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    if not path.is_file():
        raise ValueError(f"{shown}: no such table file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"{shown}: not valid YAML: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("title"), str) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise ValueError(f"{shown}: a table file is a mapping with a title and a non-empty list of rows")
    if unknown := set(data) - set(TABLE_KEYS):
        raise ValueError(f"{shown}: unknown keys {sorted(unknown)} (a table has {', '.join(TABLE_KEYS)})")
    kind = data.get("kind", "paper")
    if kind not in KINDS:
        raise ValueError(f"{shown}: kind {kind!r} is none of {', '.join(KINDS)}")
    not_covered = data.get("not_covered") or []
    if not isinstance(not_covered, list) or not all(isinstance(item, dict) and set(item) == {"label", "reason"}
                                                    and all(isinstance(text, str) for text in item.values()) for item in not_covered):
        raise ValueError(f"{shown}: not_covered is not a list of {{label, reason}} texts")
    if not isinstance(data.get("stand_in", ""), str):
        raise ValueError(f"{shown}: stand_in {data['stand_in']!r} is not a text (the paper's table the stand-in stands in for)")
    rows = []
    for number, entry in enumerate(data["rows"], start=1):
        name = entry.get("id") or entry.get("label") if isinstance(entry, dict) else None
        where = f"{shown}: row {number}" + (f" ({name})" if name else "")
        try:
            row = parse_row(entry, stand_in=data.get("stand_in") is not None)
        except ValueError as error:
            raise ValueError(f"{where} {error}") from None
        if row.id in {other.id for other in rows}:
            raise ValueError(f"{where} repeats the id of an earlier row")
        rows.append(row)
    return Table(path, data["title"], kind, data.get("stand_in"), tuple((item["label"], item["reason"]) for item in not_covered), tuple(rows))
