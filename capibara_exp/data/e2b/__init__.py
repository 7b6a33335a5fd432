"""The offline E2B pipeline: executed code -> scrubbed, validated, routed training data.

collector/sandbox/snippets/runners collect real code as E2B execution logs; jsonl, schema
and records read logs (the SDK's shape or the project's) strictly, quarantine (and
reasons) keeps the bad lines; scrub/ (a detector by context, measured on heldout/)
removes secrets; features, processing and playbooks make examples; build writes them,
at_rest reads every written file once more, and report says what it did. Nothing here imports
SeqIO or TensorFlow: the training side (the SeqIO tasks) imports `built`, which reads the
manifest and never builds, and nothing else from here.
"""
