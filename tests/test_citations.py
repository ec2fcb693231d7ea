"""Comments, docstrings, config headers, tables and docs cite what a reader can look up (issue 31 item 8).

A source is a paper and its part ("SCE supplementary, Table 2", "TCL supplementary, Sec. 2.1", "JCL
supplementary, Eq. S.3") or an official repository and path ("CEA-LIST/SCE sce/configs/..."), never a file
this repository does not ship: not "the seed" (the working copies of the papers' supplements), not "seed
Table 2" / "seed eq. 3-5" / "TCL seed Table 1", not "spec §" or "the spec", not the tags "[recall]" and
"[2nd]", no path under /work/shared, no document given by an absolute path or as a PDF file, and no spec*.md. A random seed ("3 seeds", `seed_everything`, "seed 0",
"the same seed") is not a citation and passes.
"""

import bisect
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".txt", ".toml", ".json", ".sh", ".sbatch"}
NOT_SOURCE = {"runs", "wandb", "__pycache__"}  # run outputs and caches, not part of a checkout
THIS_FILE = Path(__file__).resolve()  # holds the forbidden forms as examples below

SECTION_WORDS = r"(?:tables?|tab\.|eqs?\b|eqs?\.|equations?|sections?|sec\b|sec\.|§|figs?\b|figs?\.|figures?|prop\b|prop\.|propositions?|algorithms?|lemmas?|supplement)"
UNSHIPPED_SOURCE = re.compile(
    r"\bthe seed\b(?!-|\s*\d|\s+of\b)"  # "the seed", "the seed's": the supplement file ("the seed of the data order" is random)
    rf"|\bseed(?:'s)?\s+{SECTION_WORDS}"  # "seed Table 2", "seed eq. 3-5", "seed section 3", "seed's Algorithm 1"
    r"|\bseed\s+\d+\.\d"  # "seed 2.3": a section number (a random seed is an integer)
    r"|\bseed\s+(?-i:[A-F])(?!\w|\s+[a-z])"  # "seed D": a lettered section of the SCE supplement (not "seed A generator")
    r"|\b(?:sce|paco|jcl|tcl|npid|wang\s*&\s*liu)\s+seed\b"  # "TCL seed Table 1", "SCE seed D"
    r"|\bseed\s*/\s*spec\b|\bthe spec\b(?!\s+of\b)|\bspec\s*§|\bspec files?\b"  # "the spec of a view" is a ViewSpec
    r"|\[recall\]|\[2nd\]"
    r"|/work/shared|\bshared/(?:seeds|specs)\b|\b\w+_supplementary\.txt\b"
    r"|(?<![\w.:/])/(?:[\w.-]+/)+[\w.-]+\.(?:pdf|md|tex|docx?)\b"  # a document on someone's disk: "/home/a/papers/x.pdf"
    rf"|(?<![\w.:/])/(?:[\w.-]+/)+[\w.-]+\.txt,?\s+{SECTION_WORDS}"  # "/mnt/notes/supp.txt Sec. 2.1" (a data list is no citation)
    r"|\b[\w/.-]+\.pdf\b"  # a PDF: a paper is cited by its name and part, the file is nobody else's
    r"|\bspec\w*\.md\b",  # "SPEC.md §5.2", "spec_selfsup.md"
    re.IGNORECASE,
)


def repository_text_files() -> list[Path]:
    files = []
    for directory, subdirectories, names in os.walk(ROOT):
        subdirectories[:] = sorted(name for name in subdirectories if not name.startswith(".") and name not in NOT_SOURCE)
        files += [Path(directory) / name for name in sorted(names) if Path(name).suffix in TEXT_SUFFIXES]
    return [path for path in files if path.resolve() != THIS_FILE]


def unshipped_citations(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every citation of a source the repository does not ship, also where a
    comment or paragraph wraps it over two lines ("the\n# seed's Table 3"): the lines are joined, each
    without its indentation and comment marks, and a match is reported at the line it starts on."""
    starts, parts, offset = [], [], 0
    for line in text.splitlines():
        part = re.sub(r"^\s*(?:#+\s*)?", "", line) if parts else line
        starts.append(offset)
        parts.append(part)
        offset += len(part) + 1
    joined = " ".join(parts)
    return [(bisect.bisect_right(starts, match.start()), match.group()) for match in UNSHIPPED_SOURCE.finditer(joined)]


@pytest.mark.parametrize(
    "cited",
    [
        "# Target: seed Table 2, CIFAR-10, tau 0.2",
        "w = ... (seed eq. 3-5).",
        "shuffle-BN (seed section 3: ...)",
        "the comments of the seed's Algorithm 1 have them swapped",
        "the 95% CI half-widths as printed in the seed.",
        "Target: TCL seed Table 1, CIFAR-10",
        "(SCE seed D)",
        "self-supervised TCL, seed 2.3",
        "the multi-task baselines of the PaCo supplement (seed F, Tables 13 and 14)",
        "the queue rule (spec §5.2)",
        "as the spec says",
        "MoCo v2 67.4 [recall]",
        "ReSSL 90.20 [2nd]",
        "| paper (seed / spec) |",
        "Supplement 2.2 (`shared/seeds/tcl_supplementary.txt`)",
        'Path("/work/shared/seeds/sce_supplementary.txt")',
        "as /home/alice/papers/sce_supplementary.pdf says",
        "(/mnt/notes/tcl_supp.txt Sec. 2.1)",
        "the queue rule (SPEC.md §5.2)",
        "PaCo's recipe (docs/papers/paco_supplement.pdf, Table 9)",
    ],
)
def test_a_citation_of_an_unshipped_source_is_found(cited):
    assert {number for number, _ in unshipped_citations(f"first line\n{cited}\nlast line\n")} == {2}


def test_a_citation_wrapped_over_two_comment_lines_is_found_at_its_first_line():
    assert unshipped_citations("# line one\n# ImageNet-100 (one entry per image of the\n#   seed's Table 3 classes)\n") == [(2, "the seed")]
    assert unshipped_citations('x = 1\n    """the masked target, as in\n    seed Prop. 1."""\n') == [(3, "seed Prop")]


@pytest.mark.parametrize(
    "text",
    [
        "3 seeds",
        "seed_everything: 0",
        "L.seed_everything(0, verbose=False)",
        "--seeds 0 1 2",
        "seed 0 checkpoints, all 600 validation images",
        "one seed per point as the paper",
        "the same seed prints the same numbers",
        "differ only in their random seed",
        "numpy's generator seeded once with 0",
        "used to seed a generator of its own",
        "# drawn from a random seed\n# A generator of its own keeps them apart",
        "the seed-to-seed spread",
        "the sampler; the seed of the data order",
        "over its 30 seeds",
        "Target: SCE supplementary, Table 2, CIFAR-10, tau 0.2",
        "JCL supplementary, Sec. 3; TCL supplementary, Eq. 6; CEA-LIST/SCE sce/configs/optimizer/factory/sgd/default.yaml",
        "def build_mlp(input_dim: int, spec: MLPSpec)",
        "one augmentation spec per named view",
        "The spec of a contrastive view: the dataset's defaults",
    ],
)
def test_a_random_seed_or_a_named_source_is_not_a_citation_to_fix(text):
    assert unshipped_citations(text) == []


def test_no_comment_docstring_config_table_or_doc_cites_a_source_the_repository_does_not_ship():
    files = repository_text_files()
    assert ROOT / "README.md" in files and ROOT / "configs" / "sce_cifar10.yaml" in files and ROOT / "methods" / "sce.py" in files
    found = [
        f"{path.relative_to(ROOT)}:{number}: {cited!r}"
        for path in files
        for number, cited in unshipped_citations(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not found, "cite the paper and its part or the official repository and path instead:\n" + "\n".join(found)
