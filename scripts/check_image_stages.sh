#!/usr/bin/env bash
# The Dockerfile checked without a Docker engine, each stage in a debootstrapped Debian 12
# (the image's base) given what the Dockerfile gives it:
# - build: the stage's packages (read from its `apt-get install` lines), the sources its
#   COPY lines name, and its `RUN cmake ...` command run as written; NVIDIA's CUDA packages,
#   whose repository is out of reach here, are replaced by this machine's toolkit mounted at
#   /usr/local/cuda (a fuller toolkit than the image's three packages);
# - runtime: the stage's packages, user, the build stage's /out binaries, the configs and the
#   environment; then m3serve starts as that user on the demo model, the HEALTHCHECK command,
#   one Generate (through the tokenizer when one is given: the SentencePiece shim must load
#   from /opt/m3serve/lib) and /metrics answer, and SIGTERM stops it.
#   scripts/check_image_stages.sh [--binaries BUILD_DIR] [--arch "90;120"] [--tokenizer FILE.model]
# --binaries skips the build stage and takes m3serve & co. from a build tree of this machine.
# Needs root, debootstrap and Debian's mirror; a check by hand, not part of the tests (the
# build stage alone takes about as long as a full build here).
set -eu -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BINARIES=
ARCH="90;120"
TOKENIZER=
while (($#)); do
  case $1 in
    --binaries) BINARIES=$(cd "$2" && pwd); shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$(realpath "$2"); shift 2 ;;
    *) echo "usage: $0 [--binaries BUILD_DIR] [--arch \"90;120\"] [--tokenizer FILE.model]" >&2; exit 2 ;;
  esac
done
PORT=50071
METRICS_PORT=9471
[[ $(id -u) == 0 ]] || { echo "needs root (debootstrap, chroot)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }

# Package names of every `apt-get install` in one stage: the words after "install" and its
# options, up to the "&&" that ends the command.
stage_packages() {
  awk -v stage="$1" '
    /^FROM / { in_stage = ($0 ~ (" AS " stage "$")) }
    in_stage {
      for (i = 1; i <= NF; i++) {
        if ($i == "install" && $(i - 1) == "apt-get") { taking = 1; continue }
        if (!taking) continue
        if ($i == "&&") { taking = 0; continue }
        if ($i ~ /^-/ || $i == "\\") continue
        print $i
      }
    }' "$ROOT/Dockerfile" | tr '\n' ' '
}

ROOTS=()
# Mount points under `root`, deepest first.
mounts_under() { awk -v root="$1/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r; }
cleanup() {
  local r m pid
  if [[ -n ${RUNTIME:-} && -f $RUNTIME/tmp/m3serve.pid ]]; then
    pid=$(cat "$RUNTIME/tmp/m3serve.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  fi
  for r in "${ROOTS[@]}"; do
    for m in $(mounts_under "$r"); do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
    # Never delete through a mount that is still there (the host's /dev or CUDA toolkit).
    if [[ -n $(mounts_under "$r") ]]; then
      echo "left $r in place: still mounted: $(mounts_under "$r" | tr '\n' ' ')" >&2
      continue
    fi
    rm -rf --one-file-system "$r"
    rm -f "$r.log" "$r.build.log"
  done
}
trap cleanup EXIT

# A Debian 12 root with the given packages installed; its path in $NEW_ROOT.
debian_root() {
  local r
  r=$(mktemp -d /tmp/m3-image-stage.XXXXXX)
  chmod 755 "$r"  # mktemp's 0700 would keep the image's user out
  ROOTS+=("$r")
  debootstrap --variant=minbase bookworm "$r" http://deb.debian.org/debian >"$r.log" 2>&1 ||
    { tail -5 "$r.log"; exit 1; }
  rm -f "$r.log"
  mount -t proc proc "$r/proc"
  mount --bind /dev "$r/dev"
  cp /etc/resolv.conf "$r/etc/resolv.conf"
  chroot "$r" bash -c "export DEBIAN_FRONTEND=noninteractive; apt-get update -q >/dev/null 2>&1 &&
    apt-get install -y -q --no-install-recommends $1 >/dev/null 2>&1" ||
    { echo "apt-get install failed in the stage's root: $1"; exit 1; }
  NEW_ROOT=$r
}

if [[ -z $BINARIES ]]; then
  packages=$(stage_packages build | tr ' ' '\n' | grep -v '^cuda-' | tr '\n' ' ')
  echo "build stage packages (CUDA from this machine): $packages"
  debian_root "$packages"
  BUILD_ROOT=$NEW_ROOT
  mkdir -p "$BUILD_ROOT/usr/local/cuda"
  mount --bind "$(readlink -f /usr/local/cuda)" "$BUILD_ROOT/usr/local/cuda"
  mount -o remount,bind,ro "$BUILD_ROOT/usr/local/cuda"  # the host's toolkit: read only
  # The stage's COPY lines (sources into WORKDIR /src).
  mkdir -p "$BUILD_ROOT/src"
  awk '/^FROM / {in_stage = ($0 ~ / AS build$/)} in_stage && $1 == "COPY" {print $2, $3}' "$ROOT/Dockerfile" |
    while read -r from to; do cp -r "$ROOT/$from" "$BUILD_ROOT/src/$to"; done
  # The stage's `RUN cmake ...` command as written (its continuation lines joined).
  build_command=$(awk '/^FROM / {in_stage = ($0 ~ / AS build$/)}
                       in_stage && /^RUN cmake/ {taking = 1}
                       taking {line = $0; sub(/\\$/, "", line); printf "%s ", line; if ($0 !~ /\\$/) exit}' \
                    "$ROOT/Dockerfile" | sed 's/^RUN //')
  echo "build stage command: $build_command"
  chroot "$BUILD_ROOT" bash -c "cd /src && export CUDA_ARCHITECTURES='$ARCH' PATH=/usr/local/cuda/bin:\$PATH && $build_command" \
    >"$BUILD_ROOT.build.log" 2>&1 || { tail -30 "$BUILD_ROOT.build.log"; rm -f "$BUILD_ROOT.build.log"; exit 1; }
  rm -f "$BUILD_ROOT.build.log"
  OUT_BIN=$BUILD_ROOT/out/bin
  OUT_LIB=$BUILD_ROOT/out/lib
  echo "build stage: built $(ls "$OUT_BIN" | tr '\n' ' ')"
else
  OUT_BIN=$(mktemp -d /tmp/m3-image-out.XXXXXX)
  ROOTS+=("$OUT_BIN")
  OUT_LIB=$OUT_BIN/lib
  mkdir -p "$OUT_LIB"
  cp "$BINARIES"/server/{m3serve,m3cli,m3bench} "$BINARIES"/model/{m3make,m3check} "$OUT_BIN/"
  cp "$BINARIES/server/libm3_spm.so" "$OUT_LIB/"
  strip "$OUT_BIN"/m3* "$OUT_LIB"/*
fi

packages=$(stage_packages runtime)
echo "runtime stage packages: $packages"
debian_root "$packages"
RUNTIME=$NEW_ROOT
chroot "$RUNTIME" useradd --system --create-home --home-dir /var/lib/m3serve --shell /usr/sbin/nologin m3serve
# The stage's COPY lines.
mkdir -p "$RUNTIME/opt/m3serve/bin" "$RUNTIME/opt/m3serve/lib" "$RUNTIME/etc/m3serve"
cp "$OUT_BIN"/m3* "$RUNTIME/opt/m3serve/bin/"
cp "$OUT_LIB"/* "$RUNTIME/opt/m3serve/lib/"
cp "$ROOT/configs/server.yaml" "$ROOT/configs/prometheus.yml" "$RUNTIME/etc/m3serve/"
cp -r "$ROOT/configs/models" "$RUNTIME/etc/m3serve/models"
cp -r "$ROOT/configs/grafana" "$RUNTIME/etc/m3serve/grafana"
tokenizer_flag=
if [[ -n $TOKENIZER ]]; then
  install -m 644 "$TOKENIZER" "$RUNTIME/tmp/tokenizer.model"
  tokenizer_flag="--tokenizer /tmp/tokenizer.model"
fi

missing=$(for b in "$RUNTIME"/opt/m3serve/bin/* "$RUNTIME"/opt/m3serve/lib/*; do
  chroot "$RUNTIME" ldd "${b#"$RUNTIME"}"; done | grep "not found" || true)
[[ -z $missing ]] || { echo "libraries missing in the runtime stage:"; echo "$missing"; exit 1; }
echo "runtime stage: every binary's libraries resolve"

# The stage's ENV, USER, WORKDIR and ENTRYPOINT (the ports moved off the defaults).
as_user() {
  chroot "$RUNTIME" su -s /bin/bash m3serve -c "cd /var/lib/m3serve; export PATH=/opt/m3serve/bin:\$PATH \
    XDG_CACHE_HOME=/var/lib/m3serve/cache; $1"
}
as_user "m3serve --config /etc/m3serve/server.yaml --listen 127.0.0.1:$PORT \
  --metrics-listen 127.0.0.1:$METRICS_PORT $tokenizer_flag >/tmp/m3serve.log 2>&1 & echo \$! >/tmp/m3serve.pid"
for _ in $(seq 60); do
  as_user "m3cli --server 127.0.0.1:$PORT --connect-timeout 3 --timeout 3 health" >/dev/null 2>&1 && break
  sleep 1
done
as_user "m3cli --server 127.0.0.1:$PORT --connect-timeout 3 --timeout 3 health"
if [[ -n $TOKENIZER ]]; then
  as_user "m3cli --server 127.0.0.1:$PORT generate --text 'hello world' --max-new-tokens 8"
else
  as_user "m3cli --server 127.0.0.1:$PORT generate --ids 1,2,3 --max-new-tokens 8"
fi
series=$(chroot "$RUNTIME" bash -c "exec 3<>/dev/tcp/127.0.0.1/$METRICS_PORT; printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3; cat <&3" |
  grep -c '^m3serve_')
echo "/metrics: $series m3serve_ series"
((series > 0)) || { echo "no m3serve_ series on /metrics"; exit 1; }
pid=$(cat "$RUNTIME/tmp/m3serve.pid")
kill -TERM "$pid"
for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
rm -f "$RUNTIME/tmp/m3serve.pid"
cat "$RUNTIME/tmp/m3serve.log"
grep -q "server stopped" "$RUNTIME/tmp/m3serve.log" || { echo "m3serve did not stop cleanly"; exit 1; }
echo "image stages: OK"
