#!/usr/bin/env bash
# The Dockerfile's runtime stage, checked without a Docker engine: a minimal Debian 12 root
# (debootstrap) gets exactly the packages that stage installs (read from the Dockerfile),
# its user, binaries, configs and environment, built here in BUILD_DIR (as the build stage
# builds them); then m3serve starts as that user on the demo model, the HEALTHCHECK command,
# one Generate (with a SentencePiece model when TOKENIZER is given: the shim must load from
# /opt/m3serve/lib) and /metrics answer, and SIGTERM stops it with status 0.
#   scripts/check_runtime_stage.sh [BUILD_DIR] [TOKENIZER.model]
# Needs root, debootstrap and Debian's mirror; not part of the tests. It does not check the
# build stage (NVIDIA's CUDA repository) or the GPU path (--gpus): run by hand.
set -eu -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$ROOT/build}
TOKENIZER=${2:-}
PORT=50071
METRICS_PORT=9471
[[ $(id -u) == 0 ]] || { echo "needs root (debootstrap, chroot)" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }

# The runtime stage's packages: the `apt-get install` after "AS runtime", up to its "&&".
packages=$(awk '/^FROM .* AS runtime/ {in_stage = 1}
                in_stage && /apt-get install/ {take = 1}
                take {for (i = 1; i <= NF; i++) {
                        if ($i == "&&" && seen) {exit}
                        if ($i ~ /^lib/) {print $i; seen = 1}}}' "$ROOT/Dockerfile" | tr '\n' ' ')
[[ -n $packages ]] || { echo "found no runtime packages in the Dockerfile" >&2; exit 1; }
echo "runtime packages: $packages"

R=$(mktemp -d /tmp/m3-runtime-stage.XXXXXX)
chmod 755 "$R"  # the root of the tree: mktemp's 0700 would keep the m3serve user out
cleanup() {
  [[ -f $R/tmp/m3serve.pid ]] && kill "$(cat "$R/tmp/m3serve.pid")" 2>/dev/null || true
  umount "$R/proc" "$R/dev" 2>/dev/null || true
  rm -rf --one-file-system "$R"
}
trap cleanup EXIT
debootstrap --variant=minbase bookworm "$R" http://deb.debian.org/debian >"$R.debootstrap.log" 2>&1 ||
  { tail -5 "$R.debootstrap.log"; exit 1; }
rm -f "$R.debootstrap.log"
mount -t proc proc "$R/proc"
mount --bind /dev "$R/dev"
cp /etc/resolv.conf "$R/etc/resolv.conf"
chroot "$R" bash -c "export DEBIAN_FRONTEND=noninteractive; apt-get update -q >/dev/null 2>&1 &&
  apt-get install -y -q --no-install-recommends $packages >/dev/null 2>&1 &&
  useradd --system --create-home --home-dir /var/lib/m3serve --shell /usr/sbin/nologin m3serve"

# The COPY lines of the runtime stage.
mkdir -p "$R/opt/m3serve/bin" "$R/opt/m3serve/lib" "$R/etc/m3serve"
cp "$BUILD"/server/{m3serve,m3cli,m3bench} "$BUILD"/model/{m3make,m3check} "$R/opt/m3serve/bin/"
cp "$BUILD/server/libm3_spm.so" "$R/opt/m3serve/lib/"
strip "$R"/opt/m3serve/bin/* "$R"/opt/m3serve/lib/*
cp "$ROOT/configs/server.yaml" "$ROOT/configs/prometheus.yml" "$R/etc/m3serve/"
cp -r "$ROOT/configs/models" "$R/etc/m3serve/models"
cp -r "$ROOT/configs/grafana" "$R/etc/m3serve/grafana"
tokenizer_flag=
if [[ -n $TOKENIZER ]]; then
  install -m 644 "$TOKENIZER" "$R/tmp/tokenizer.model"
  tokenizer_flag="--tokenizer /tmp/tokenizer.model"
fi

missing=$(for b in "$R"/opt/m3serve/bin/* "$R"/opt/m3serve/lib/*; do chroot "$R" ldd "${b#"$R"}"; done | grep "not found" || true)
[[ -z $missing ]] || { echo "libraries missing in the runtime stage:"; echo "$missing"; exit 1; }
echo "every binary's libraries resolve"

# The stage's ENV, USER, WORKDIR and ENTRYPOINT (the ports moved off the defaults).
as_user() {
  chroot "$R" su -s /bin/bash m3serve -c "cd /var/lib/m3serve; export PATH=/opt/m3serve/bin:\$PATH \
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
series=$(chroot "$R" bash -c "exec 3<>/dev/tcp/127.0.0.1/$METRICS_PORT; printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3; cat <&3" |
  grep -c '^m3serve_')
echo "/metrics: $series m3serve_ series"
((series > 0)) || { echo "no m3serve_ series on /metrics"; exit 1; }
pid=$(cat "$R/tmp/m3serve.pid")
kill -TERM "$pid"
for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
rm -f "$R/tmp/m3serve.pid"
cat "$R/tmp/m3serve.log"
grep -q "server stopped" "$R/tmp/m3serve.log" || { echo "m3serve did not stop cleanly"; exit 1; }
echo "runtime stage: OK"
