#!/usr/bin/env bash
# The 30-second tour from a shell, against a running server (`make run` in another terminal).
set -euo pipefail
URL=${OMNIDIT_URL:-http://127.0.0.1:8000}
OMNIDIT=${OMNIDIT:-.venv/bin/omnidit}

curl -s "$URL/v1/images/generations" -H 'Content-Type: application/json' \
     -d '{"model": "digits", "prompt": "a handwritten 7", "seed": 1}' | python3 -c \
     'import sys, json, base64; open("7.png", "wb").write(base64.b64decode(json.load(sys.stdin)["data"][0]["b64_json"]))'
curl -s "$URL/v1/models" | python3 -c 'import sys, json; print([m["id"] for m in json.load(sys.stdin)["data"]])'
"$OMNIDIT" generate "the digit seven" -o seven.png --seed 1   # the same model, in this process, no server
