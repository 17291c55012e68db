#!/usr/bin/env bash
# blockspec batch at the server's full batch (16 in flight = server.max_batch): 200 requests (the 16 held-out prompts
# in turn, 64 new tokens each, greedy), speculative (the config's k) then plain (num_speculative_tokens 0), each
# against `--config deploy/config.yaml` served for the job. Prints each run's totals line.
set -euo pipefail
cd "$(dirname "$0")/../../.."
work=$(mktemp -d)
.venv/bin/python - "$work" <<'PY'
import json, sys
prompts = [json.loads(line) for line in open("models/base/heldout_prompts.jsonl")]
for name, extra in (("spec", {}), ("plain", {"num_speculative_tokens": 0})):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for i in range(200):
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": 64, "temperature": 0, **extra}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
PY
for name in spec plain; do
  echo -n "$name: "
  .venv/bin/blockspec batch "$work/$name.jsonl" "$work/$name.out.jsonl" --config deploy/config.yaml --quiet 2>&1 | tail -1
done
.venv/bin/python - "$work" <<'PY'
import json, sys
text = {n: {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"]["choices"][0]["text"]
            for l in open(f"{sys.argv[1]}/{n}.out.jsonl")} for n in ("spec", "plain")}
same = sum(text["spec"][i] == text["plain"][i] for i in text["plain"])
print(f"identical texts: {same} of {len(text['plain'])}")
PY
rm -rf "$work"
