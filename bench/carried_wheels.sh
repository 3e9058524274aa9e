# Sourced by the GPU scripts: the wheels carried in .whl/ that this machine lacks, installed
# into /tmp/site and put on PYTHONPATH before the checkout ($ZERO3_TREE, default the checkout).
# By project name, so pip picks the wheel that fits this interpreter (several may be carried);
# a project the machine has already is kept as it is.
if ls .whl/*.whl >/dev/null 2>&1; then
    projects=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort -u | python3 -c '
import importlib.metadata as metadata, sys
for name in sys.stdin.read().split():
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(name)')
    echo "installing from .whl: $projects"
    [ -n "$projects" ] && python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site $projects 2>&1 | grep -v "WARNING: Target directory" | tail -3
    export PYTHONPATH=/tmp/site:${ZERO3_TREE:-$PWD}
else
    export PYTHONPATH=${ZERO3_TREE:-$PWD}
fi
