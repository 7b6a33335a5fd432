"""The offline E2B pipeline: executed code -> scrubbed, validated, routed training data.

collector/sandbox/snippets/runners collect real code as E2B execution logs; jsonl, schema
and records read logs (the SDK's shape or the project's) strictly, quarantine (and
reasons) keeps the bad lines; scrub (on detect-secrets, with patterns for what it lacks,
measured on heldout/) removes secrets; features, processing and playbooks make examples;
build writes them with a manifest and report says what it did. Nothing here imports
SeqIO or TensorFlow: the training side (capibara_exp/data/routing_tasks.py) imports
`build` to build on first read, and nothing else from here.
"""
