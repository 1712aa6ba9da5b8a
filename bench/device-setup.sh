#!/usr/bin/env bash
# Source on an air-gapped GPU box: installs the carried wheels (.whl/) that its
# image lacks (trl, soup-cli, peft, datasets and their pure-Python needs) into
# /tmp/site, byte-compiled at install as pip does by default (so no timed run pays
# for it), ahead of the image's own packages. Torch stays the image's; the header
# of every run says which. The wheels: bench/README.md.
set -e
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
set +e
