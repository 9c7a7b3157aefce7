"""CTest python.pip (not a pytest module): `python3 -m pip install --no-build-isolation --no-deps --target <dir> <copy of ./python>`,
offline, then imports the installed package from outside the source and build trees.

Usage: pip_test.py <source dir> <scratch dir> [<built _core module>]. With the built module, setup.py
packages it (KVEVICT_PREBUILT_CORE) instead of compiling the extension a second time in the same CI
run: the test covers the pip path (pyproject/setup.py, the package files, the install) but not
setup.py's compile step, which docs/python.md measures by hand. The copy keeps the pip build's
leftovers (build/, *.egg-info) out of the source tree.
"""
import os
import shutil
import subprocess
import sys

source, scratch = sys.argv[1], sys.argv[2]
prebuilt = sys.argv[3] if len(sys.argv) > 3 else ""
shutil.rmtree(scratch, ignore_errors=True)
tree = os.path.join(scratch, "src")
shutil.copytree(os.path.join(source, "include"), os.path.join(tree, "include"))
shutil.copy(os.path.join(source, "CMakeLists.txt"), tree)  # setup.py reads the version there
shutil.copytree(os.path.join(source, "python"), os.path.join(tree, "python"),
                ignore=shutil.ignore_patterns("tests", "examples", "build", "*.egg-info", "__pycache__"))
target = os.path.join(scratch, "site")
env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
env.pop("PYTHONPATH", None)  # the build tree's package must not be what pip or the import sees
if prebuilt:
    env["KVEVICT_PREBUILT_CORE"] = prebuilt
cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
       "--target", target, os.path.join(tree, "python")]
r = subprocess.run(cmd, env=env, capture_output=True, text=True)
if r.returncode != 0:
    sys.exit(f"pip install failed ({' '.join(cmd)}):\n{r.stdout}\n{r.stderr}")
check = """
import sys, torch, kvevict
from kvevict import presses
assert kvevict.__file__.startswith(sys.argv[1]), kvevict.__file__
k, q = torch.randn(1, 2, 64, 8), torch.randn(1, 4, 64, 8)
keys, values = presses.SnapKV(budget=40, window=8)(k, k, q)
assert keys.shape == (1, 2, 40, 8)
from importlib.metadata import version
print("pip-installed kvevict", version("kvevict"), "works:", kvevict.__file__)
"""
env = dict(os.environ, PYTHONPATH=target)
r = subprocess.run([sys.executable, "-c", check, target], env=env, cwd=scratch, capture_output=True, text=True)
if r.returncode != 0:
    sys.exit(f"the pip-installed package does not import:\n{r.stdout}\n{r.stderr}")
print(r.stdout.strip())
