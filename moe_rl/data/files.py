"""Rows of local dataset files, read the way `datasets.load_dataset` reads them: a file (parquet, jsonl, a `.json`
array or lines, arrow), a glob, a list of files, a folder of data files (Hub-style shards such as
`train-00000-of-00001.parquet`, the split chosen by `data.split` from the file names as the Hub does), or a folder
written by `save_to_disk` (a Dataset, or a DatasetDict and its `data.split`).

The happy path is datasets' own loader (`load_dataset(builder, data_files=...)`, `load_from_disk`), so the rows are
the ones a Hugging Face user gets (missing keys and struct fields filled with None). Where it fails, a reader of
our own goes through the files line by line (jsonl) or with pyarrow to name the file and line (or row) at fault;
where that reader finds no fault (e.g. a column holding numbers in one row and strings in another, which Arrow
cannot hold but our rows can), its rows are used. Each row is labelled `file:line` (jsonl) or `file:row N` (from 1)
for error messages.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

from moe_rl.common.errors import ConfigError
from moe_rl.data.config import GLOB_CHARS, path_entries, path_problem


class DataError(ValueError):
    """A data file that cannot be used as it is; the message names the file and line (or row) and the key."""


BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
"""The `datasets` builder of each file suffix; any other suffix is read as jsonl."""


def read_rows(path, split: str = "train", key: str = "data.path") -> list[tuple[str, dict]]:
    """(where, row) of every row `path` (data.path: a str or a list of str) names; `split` picks the split of a
    DatasetDict or of a folder of split-named files. `key` names the setting in errors."""
    try:
        entries = path_entries(path)
    except ConfigError as e:
        raise DataError(f"{key}: {e}") from None
    if not entries:
        raise DataError(f"{key} is empty: name a file, a folder or a list of files")
    for entry in entries:
        if (problem := path_problem(entry)) is not None:
            raise FileNotFoundError(f"{key}={entry!r}: {problem}")
    if len(entries) == 1 and Path(entries[0]).is_dir():
        return _folder_rows(Path(entries[0]), split)
    files = []
    for entry in entries:
        found = sorted(glob.glob(entry)) if any(c in entry for c in GLOB_CHARS) else [entry]
        files += [Path(f) for f in found]
    folders = [str(f) for f in files if f.is_dir()]
    if folders:
        raise DataError(f"{key}: {folders} are folders; a list or glob names files (or give one folder alone)")
    return _file_rows(files)


def _quiet(datasets) -> None:
    """No progress bars or log lines from datasets on every rank (a file it fails on, our reader names)."""
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)


def _folder_rows(folder: Path, split: str) -> list[tuple[str, dict]]:
    """A `save_to_disk` folder, or a folder of data files whose names give their split (as on the Hub)."""
    # heavy: datasets, imported on first use
    import datasets
    from datasets.data_files import DataFilesDict, get_data_patterns

    _quiet(datasets)
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        ds = datasets.load_from_disk(str(folder))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{folder}: a DatasetDict with splits {list(ds)}, none named data.split={split!r}")
            ds = ds[split]
        return [(f"{folder}:row {i}", row) for i, row in enumerate(ds.to_list(), start=1)]
    try:
        splits = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except (FileNotFoundError, datasets.exceptions.DataFilesNotFoundError) as e:
        raise DataError(
            f"{folder}: a folder, but neither a dataset saved with save_to_disk nor a folder of data files "
            f"(parquet, jsonl, json, arrow) ({e})"
        ) from None
    if split not in splits:
        raise DataError(f"{folder}: its files hold the splits {list(splits)}, none named data.split={split!r}")
    return _file_rows([Path(f) for f in splits[split]])


def _file_rows(files: list[Path]) -> list[tuple[str, dict]]:
    """The rows of `files` in order, through datasets' loader; where it fails, through our own reader, which names
    the bad file and line."""
    # heavy: datasets, imported on first use
    import datasets

    _quiet(datasets)
    builders = {BUILDERS.get(f.suffix, "json") for f in files}
    if len(builders) > 1:
        raise DataError(f"{[str(f) for f in files]}: files of different kinds ({sorted(builders)}); use one kind")
    try:
        ds = datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")
        rows = ds.to_list()  # decodes every string: a non-UTF-8 one (which Arrow's JSON reader lets in) fails here
    except Exception:  # noqa: BLE001 - whatever datasets raises, our reader names the file and line at fault
        return [pair for f in files for pair in _precise_rows(f)]
    return list(zip(_labels(files, len(rows)), rows, strict=True))


def _labels(files: list[Path], total: int) -> list[str]:
    """`file:line` / `file:row N` of each row datasets read from `files`, in its order; `file:row N` over all the
    files when the counts do not add up (a layout datasets reads its own way)."""
    labels = []
    for f in files:
        if f.suffix == ".parquet":
            # heavy: pyarrow, imported on first use
            import pyarrow.parquet as pq

            labels += [f"{f}:row {i}" for i in range(1, pq.ParquetFile(f).metadata.num_rows + 1)]
        elif f.suffix == ".arrow" or (f.suffix == ".json" and _is_json_array(f)):
            labels += [where for where, _ in _precise_rows(f)]
        else:
            with f.open("rb") as lines:
                labels += [f"{f}:{n}" for n, raw in enumerate(lines, start=1) if raw.strip()]
    if len(labels) != total:
        name = str(files[0]) if len(files) == 1 else f"{files[0]} and {len(files) - 1} more"
        return [f"{name}:row {i}" for i in range(1, total + 1)]
    return labels


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def _precise_rows(path: Path) -> list[tuple[str, dict]]:
    """Our own reader of one file: every row with its place, or a DataError naming the file and line at fault."""
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.suffix == ".arrow":
        return _arrow_rows(path)
    if path.suffix == ".json" and _is_json_array(path):
        return _json_array_rows(path)
    return list(_jsonl_rows(path))


def _jsonl_rows(path: Path):
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None


def _json_array_rows(path: Path) -> list[tuple[str, dict]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 ({e.reason} at byte {e.start} of the file)") from None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    return [(f"{path}:row {i}", row) for i, row in enumerate(rows, start=1)]


def _parquet_rows(path: Path) -> list[tuple[str, dict]]:
    # heavy: pyarrow, imported on first use
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file, truncated or damaged ({e})") from None
    return [(f"{path}:row {i}", row) for i, row in enumerate(table.to_pylist(), start=1)]


def _arrow_rows(path: Path) -> list[tuple[str, dict]]:
    # heavy: pyarrow, imported on first use
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Arrow stream file, truncated or damaged ({e})") from None
    return [(f"{path}:row {i}", row) for i, row in enumerate(table.to_pylist(), start=1)]
