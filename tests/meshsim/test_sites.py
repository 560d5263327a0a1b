"""Call sites: a ledger entry names the user's line; a library's own line is kept as its ``via``."""

from __future__ import annotations

import inspect
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, init_device_mesh

import meshsim
from shardtensor import ShardTensor


def _line_after(frame_line: int) -> str:
    """``test_sites.py:N in <function>`` where N is the line after ``frame_line``."""
    return f"test_sites.py:{frame_line + 1}"


def test_a_from_local_entry_names_the_calling_line_and_keeps_shardtensors() -> None:
    def body() -> tuple[meshsim.Ledger, int]:
        mesh = init_device_mesh("cpu", (2,))
        with meshsim.record() as ledger:
            line = inspect.currentframe().f_lineno  # type: ignore[union-attr]
            ShardTensor.from_local(torch.ones(dist.get_rank() + 1, 2), mesh, [Shard(0)])
        return ledger, line

    (ledger, line), _ = meshsim.run(body, 2)
    (entry,) = ledger.calls
    assert entry.site == f"{_line_after(line)} in body"
    assert entry.via is not None and entry.via.startswith("shardtensor/_collectives.py:")
    assert entry.via.endswith(" in all_gather_shapes")
    assert "via" in ledger.table().splitlines()[0].split()  # the detail column
    assert entry.via in ledger.table()


def test_a_direct_call_has_no_via_and_no_via_column() -> None:
    def body() -> tuple[meshsim.Ledger, int]:
        with meshsim.record() as ledger:
            line = inspect.currentframe().f_lineno  # type: ignore[union-attr]
            dist.all_reduce(torch.ones(2))
        return ledger, line

    (ledger, line), _ = meshsim.run(body, 2)
    assert [(c.site, c.via) for c in ledger.calls] == [(f"{_line_after(line)} in body", None)]
    assert "via" not in ledger.table().splitlines()[0].split()


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable package ``userlib_sites`` whose ``total`` calls all_reduce on line 5."""
    package = tmp_path / "userlib_sites"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            """\
            import torch.distributed as dist


            def total(t):
                dist.all_reduce(t)
                return t
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "userlib_sites", raising=False)
    return "userlib_sites"


def _library_call() -> tuple[str, str | None]:
    import userlib_sites  # type: ignore[import-not-found]

    def body() -> tuple[str, str | None]:
        with meshsim.record() as ledger:
            userlib_sites.total(torch.ones(2))
        (entry,) = ledger.calls
        return entry.site, entry.via

    return meshsim.run(body, 2)[0]


def test_declared_library_code_names_its_caller(library: str) -> None:
    assert _library_call() == ("__init__.py:5 in total", None)  # not declared: its line is the site
    with meshsim.library_code(library) as folders:
        assert [os.path.basename(f.rstrip(os.sep)) for f in folders] == [library]
        site, via = _library_call()
        assert site.startswith("test_sites.py:") and site.endswith(" in body")
        assert via == "userlib_sites/__init__.py:5 in total"
        assert os.environ["MESHSIM_LIBRARY"].endswith(folders[0])  # the hand-off to child processes
    assert _library_call() == ("__init__.py:5 in total", None)  # undone with the block
    assert "MESHSIM_LIBRARY" not in os.environ


@pytest.mark.parametrize("name", ["no_such_module_anywhere", "/no/such/folder"])
def test_an_unknown_library_is_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=f"library_code: .*{name!r}"):
        with meshsim.library_code(name):
            pass
