#!/bin/sh
# Install the real data sets from Debian's packages when they are missing, apt is available and we
# are root: Fashion-MNIST (dataset-fashion-mnist: IDX files in /usr/share/datasets/fashion-mnist) and
# the fortunes text corpus (fortunes: /usr/share/games/fortunes). Never fails the set-up: distlab
# itself says clearly where it looked if a data set is still missing.
set -u
fmnist="${DISTLAB_SYSTEM_DATASETS:-/usr/share/datasets}/fashion-mnist"
missing=""
if [ -f "$fmnist/train-images-idx3-ubyte.gz" ] && [ -f "$fmnist/t10k-labels-idx1-ubyte.gz" ]; then
    echo "Fashion-MNIST: found in $fmnist"
else
    missing="dataset-fashion-mnist"
fi
if [ -f /usr/share/games/fortunes/fortunes.dat ]; then
    echo "fortunes: found in /usr/share/games/fortunes"
else
    missing="$missing fortunes"
fi
missing=$(echo $missing)  # trimmed
[ -z "$missing" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-get not available: put the Fashion-MNIST IDX files in \$DISTLAB_DATA/fashion-mnist and fortune" \
         "files in \$DISTLAB_DATA/fortunes"
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "not root; run: sudo apt-get install -y $missing"
    exit 0
fi
echo "installing Debian's $missing"
export DEBIAN_FRONTEND=noninteractive
# shellcheck disable=SC2086 # one word per package
apt-get update -qq && apt-get install -y -qq $missing >/dev/null || echo "apt-get install $missing failed; see above"
exit 0
