"""The C kernels' interface is declared once, in `csrc/kernels.h`, and held to it.

The library exports exactly the header's functions; a prototype, struct field or definition
edited on one side only fails the build (each case compiles a mutated copy of the sources in a
temporary directory); the ctypes bindings follow a type changed on both sides, where a binding
kept by hand would pass the old type; and the header reader refuses what it cannot bind.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from modelyard.config import EngineSettings
from modelyard.engine import cpu_kernels, kernel_build, kernel_header

COMPILER = kernel_build.compiler()
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler here")
CSRC = kernel_build.SOURCES[0].parent
FAST = ("-O1",)  # after -O3: the mutated copies need to compile, not to be fast


def mutated(tmp_path: Path, edits: list[tuple[str, str, str]]) -> tuple[Path, ...]:
    """The kernels' sources copied under `tmp_path`, each (file, old, new) edit applied once."""
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    for name, old, new in edits:
        text = (copy / name).read_text()
        assert text.count(old) == 1, (name, old)
        (copy / name).write_text(text.replace(old, new))
    return tuple(copy / source.name for source in kernel_build.SOURCES)


def build(sources: tuple[Path, ...], tmp_path: Path) -> Path:
    assert COMPILER is not None
    return kernel_build.build(sources, COMPILER, tmp_path / "kernels", FAST)


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm here")
def test_the_library_exports_exactly_the_headers_functions() -> None:
    assert COMPILER is not None
    library = kernel_build.build(
        kernel_build.SOURCES, COMPILER, EngineSettings().cache_dir / "kernels"
    )
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", str(library)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines()}  # functions, data, all
    declared = set(kernel_header.read().functions)
    assert exported == declared
    assert all(name.startswith("my_") for name in exported)
    # the reader found every prototype the header writes (not a subset that happens to match)
    prototypes = re.findall(r"MY_API[^;(]*?\b(my_\w+)\s*\(", kernel_header.HEADER.read_text())
    assert declared == set(prototypes) and len(prototypes) >= 12


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        # a prototype's parameter type changed in the header only
        (
            ("kernels.h", "int64_t x_stride, float eps);", "int64_t x_stride, double eps);"),
            "my_rms_norm",
        ),
        # a definition's parameter type changed in its .c file only
        (
            ("fused_ops.c", "int64_t x_stride, float eps) {", "int64_t x_stride, double eps) {"),
            "my_rms_norm",
        ),
        # a struct field renamed in the header only
        (
            ("kernels.h", "dim, row_stride, max_positions;", "dim, stride, max_positions;"),
            "row_stride",
        ),
        # an exported function the header does not declare
        (
            ("kernels.h", "MY_API int my_int8_matmul_vectorized(void);", ""),
            "my_int8_matmul_vectorized",
        ),
    ],
    ids=["header-prototype", "definition", "struct-field", "undeclared"],
)
def test_an_edit_on_one_side_of_the_interface_fails_the_build(
    tmp_path: Path, edit: tuple[str, str, str], complaint: str
) -> None:
    with pytest.raises(RuntimeError, match=complaint):
        build(mutated(tmp_path, [edit]), tmp_path)


def test_the_bindings_follow_a_type_changed_in_the_header(tmp_path: Path) -> None:
    """`eps` made a double in both the header and the definition: the generated binding passes
    a double and the norm is right; the stale binding (a float, as a hand-kept list would still
    say) hands the C code other bits and the norm is not."""
    sources = mutated(
        tmp_path,
        [
            ("kernels.h", "int64_t x_stride, float eps);", "int64_t x_stride, double eps);"),
            ("fused_ops.c", "int64_t x_stride, float eps) {", "int64_t x_stride, double eps) {"),
        ],
    )
    library = ctypes.CDLL(str(build(sources, tmp_path)))
    header = kernel_header.parse((sources[0].parent / "kernels.h").read_text())
    assert header.functions["my_rms_norm"].argtypes[-1] is ctypes.c_double
    x, weight = torch.ones(2, 8), torch.full((8,), 3.0)
    expected = weight / (1.0 + 1.0) ** 0.5  # mean square 1, eps 1

    def norm(binding: kernel_header.Header) -> torch.Tensor:
        rms_norm = kernel_header.bind(library, binding)["my_rms_norm"]
        out = torch.empty(2, 8)
        rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), 2, 8, 8, 1.0)
        return out

    assert torch.allclose(norm(header), expected.expand(2, 8))
    assert not torch.allclose(norm(kernel_header.read()), expected.expand(2, 8))


@pytest.mark.parametrize(
    "extra",
    [
        "int my_plain(int a);",  # not marked MY_API
        "MY_API int unprefixed(int a);",
        "MY_API int my_sized(size_t n);",  # a type the reader does not know
        "MY_API int my_by_value(my_linear w);",  # a struct by value
        "typedef struct { int a; } my_linear;",  # a struct declared twice
        "typedef struct { int a, a; } my_twice;",
        "typedef union { int a; float b; } my_union;",
        "MY_API int my_rms_norm(void);",  # a function declared twice
    ],
)
def test_the_header_reader_refuses_what_it_cannot_bind(extra: str) -> None:
    text = kernel_header.HEADER.read_text()
    kernel_header.parse(text)
    with pytest.raises(kernel_header.HeaderError):
        kernel_header.parse(text.replace("#endif", extra + "\n#endif"))


def test_structs_are_filled_by_field_name_only() -> None:
    linear = cpu_kernels.Linear(out_features=3, in_features=4)
    assert (linear.out_features, linear.in_features) == (3, 4)
    with pytest.raises(AttributeError):
        cpu_kernels.Attention(no_such_field=1)
    assert [name for name, _ in cpu_kernels.Linear._fields_] == [
        "weight",
        "weight_sums",
        "scale",
        "bias",
        "inv_smooth",
        "amx_weight",
        "out_features",
        "in_features",
    ]
