"""Installs as users install: the extension refuses, with the fix, to load under another torch."""
import os
import subprocess
import sys

import pytest
import torch

import fused_reducer
from fused_reducer import check_torch_version


def test_the_same_torch_passes():
    check_torch_version("2.14.1+cu130", "2.14.1+cu130")


@pytest.mark.parametrize("running", ["2.15.0+cu130", "2.14.0+cu130", "2.14.1+cpu", "2.14.1"])
def test_another_torch_raises_import_error_naming_both_versions_and_the_fix(running):
    with pytest.raises(ImportError) as info:
        check_torch_version("2.14.1+cu130", running)
    message = str(info.value)
    assert "2.14.1+cu130" in message and running in message, message
    assert "pip install --no-build-isolation" in message and "--force-reinstall" in message, message


def test_an_unrecorded_build_is_not_refused():
    check_torch_version(None, "2.14.1+cu130")  # built before versions were recorded


def test_the_installed_copy_records_the_torch_it_runs_under():
    assert fused_reducer._BUILD_TORCH == torch.__version__


def test_import_under_another_torch_fails_before_loading_the_extension(tmp_path):
    # The installed package, linked file by file, with a build record naming another torch.
    installed = os.path.dirname(fused_reducer.__file__)
    package = tmp_path / "fused_reducer"
    package.mkdir()
    for name in os.listdir(installed):
        if name not in ("_build_torch.py", "__pycache__"):
            (package / name).symlink_to(os.path.join(installed, name))
    (package / "_build_torch.py").write_text("TORCH_VERSION = '2.0.0+elsewhere'\n")
    code = ("import sys\n"
            "try:\n"
            "    import fused_reducer\n"
            "except ImportError as e:\n"
            "    print('ImportError:', e)\n"
            "print('_C loaded:', 'fused_reducer._C' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "ImportError: fused_reducer was compiled against torch 2.0.0+elsewhere" in run.stdout, run.stdout
    assert torch.__version__ in run.stdout, run.stdout
    assert "_C loaded: False" in run.stdout, run.stdout


def test_the_extension_shares_torchs_libstdcxx():
    """A toolchain whose g++ adds -static-libstdc++ (the GPU machines' image) once gave the
    extension a second C++ runtime, and its first `std::ostringstream << n` crashed inside torch's
    process: setup.py links the shared one, and the built file must show it."""
    from fused_reducer import _C
    dynamic = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    assert "[libstdc++.so" in dynamic, f"{_C.__file__} does not link libstdc++ dynamically"
    defined = subprocess.run(["nm", "-D", "--defined-only", "-C", _C.__file__],
                             capture_output=True, text=True, check=True).stdout
    # Symbols only libstdc++ itself defines (not templates a header instantiates anywhere).
    runtime = [line for line in defined.splitlines()
               if ("std::basic_ostream<char" in line and "::_M_insert<long>" in line)
               or "std::locale::classic()" in line or "std::ios_base::Init::Init()" in line]
    assert not runtime, f"{_C.__file__} carries its own copy of libstdc++: {runtime[:3]}"
