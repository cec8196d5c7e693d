"""Print each dense e2e row's tuned launch (the kernel string's tail) from a bench summary.json."""

import json
import sys

for r in json.load(open(sys.argv[1]))["rows"]:
    if r["method"] == "dense":
        print(r["model"], r["context"], r["batch"], r["kernel"].split("launch ")[-1])
