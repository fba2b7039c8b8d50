#!/usr/bin/env bash
# Ray on a lent GPU machine, whose calls carry at most 64 MiB each and which cannot reach a package index: the ray
# wheel (about 79 MB) goes in two parts over two calls made back to back (an ignored folder carried by the first
# call is still there for the second while the machine stays warm), and is joined and installed there.
#
#   bash benchmarks/gpu_ray_parts.sh pack       # here: data/ray_a/ (the wheel's first part) and data/ray_b/ (its
#                                               # second part, ray's dependencies, the wheel's sha256)
#   # call 1: carry ["data/ray_a"], command: true
#   # call 2: carry ["data/ray_b", ...], command: bash benchmarks/gpu_ray_parts.sh install && ...
#   bash benchmarks/gpu_ray_parts.sh install    # there: join, check the sha256, install ray (the dependencies the
#                                               # machine lacks come from data/ray_b), print its version
#
# RAY_VERSION (default: the ray installed here, else 2.60.0) and RAY_PYTHON (default 3.12, the lent machines') pick
# the wheel. PYTHON (default python3) is the interpreter that installs it there.
set -uo pipefail
cd "$(dirname "$0")/.."
A=data/ray_a; B=data/ray_b; PART=50M
PY=${PYTHON:-python3}
die() { echo "error: gpu_ray_parts.sh: $*" >&2; exit 2; }
case "${1:-}" in
  pack)
    ver=${RAY_VERSION:-$("$PY" -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)}
    pyv=${RAY_PYTHON:-3.12}
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip download -q --only-binary=:all: --python-version "$pyv" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      -d "$tmp" "ray==$ver" || die "pip download of ray==$ver for Python $pyv failed (no package index here?)"
    whl=$(ls "$tmp"/ray-"$ver"-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || die "no ray-$ver wheel among the downloads in $tmp"
    rm -rf "$A" "$B"; mkdir -p "$A" "$B"
    split -b "$PART" -d "$whl" "$A/$(basename "$whl").part-"
    for p in "$A"/*.part-0[1-9]; do [ -e "$p" ] && mv "$p" "$B/"; done
    [ "$(ls "$B" | grep -c '\.part-')" -ge 1 ] || die "the wheel split into one part only: nothing to carry in two calls"
    (cd "$tmp" && sha256sum "$(basename "$whl")") > "$B/ray.sha256"
    for f in "$tmp"/*.whl; do [ "$f" = "$whl" ] || cp "$f" "$B/"; done
    du -sh "$A" "$B"
    echo "carry [\"$A\"] in one call, then [\"$B\"] in the next (back to back), and run: bash $0 install"
    ;;
  install)
    [ -d "$B" ] || die "no $B here: carry [\"$B\"] in this call"
    ls "$A"/*.part-00 >/dev/null 2>&1 || die "no $A/*.part-00 here: carry [\"$A\"] in the call just before this one (the machine must still be warm)"
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    name=$(awk '{print $2}' "$B/ray.sha256")
    cat "$A/$name".part-00 "$B/$name".part-* > "$tmp/$name"
    (cd "$tmp" && sha256sum -c --quiet "$OLDPWD/$B/ray.sha256" >/dev/null 2>&1) || die "the joined $name does not match its sha256 (a part is missing or from another wheel)"
    cp "$B"/*.whl "$tmp/" 2>/dev/null || true
    log=$B/pip.log
    "$PY" -m pip install -q --no-index --find-links "$tmp" "$tmp/$name" > "$log" 2>&1 \
      || "$PY" -m pip install -q --no-index --find-links "$tmp" --user "$tmp/$name" >> "$log" 2>&1 \
      || die "pip could not install $name from the carried wheels (its output: $log)"
    "$PY" -c "import ray; print('ray', ray.__version__)"
    ;;
  *) die "expected 'pack' (here) or 'install' (on the lent machine), got '${1:-}'" ;;
esac
