#!/usr/bin/env bash
# Source on an air-gapped GPU box: installs the carried wheels (.whl/) that its
# image lacks (trl, soup-cli, peft, datasets and their pure-Python needs) into
# /tmp/site and puts them ahead of the image's own packages. Torch stays the
# image's; the header of every run says which.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
set +e
