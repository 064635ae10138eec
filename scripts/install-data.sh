#!/bin/sh
# Install Fashion-MNIST from Debian's package (IDX files in /usr/share/datasets/fashion-mnist)
# when it is missing, apt is available and we are root. Never fails the set-up: distlab itself
# says clearly where it looked if the data is still missing.
set -u
dir="${DISTLAB_SYSTEM_DATASETS:-/usr/share/datasets}/fashion-mnist"
if [ -f "$dir/train-images-idx3-ubyte.gz" ] && [ -f "$dir/t10k-labels-idx1-ubyte.gz" ]; then
    echo "Fashion-MNIST: found in $dir"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "Fashion-MNIST: apt-get not available; put the four IDX files in \$DISTLAB_DATA/fashion-mnist"
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "Fashion-MNIST: not root; run: sudo apt-get install -y dataset-fashion-mnist"
    exit 0
fi
echo "Fashion-MNIST: installing Debian's dataset-fashion-mnist"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null || \
    echo "Fashion-MNIST: apt-get install dataset-fashion-mnist failed; see above"
exit 0
