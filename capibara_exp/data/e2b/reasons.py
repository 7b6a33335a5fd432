"""Why a line is quarantined: stable names (manifest keys, the quarantine file's `reason`)."""

EMPTY_FILE = "empty_file"  # the file has no lines at all
OVERSIZED_LINE = "oversized_line"  # longer than max_line_bytes
INVALID_UTF8 = "invalid_utf8"  # bytes that are not UTF-8
BINARY_GARBAGE = "binary_garbage"  # NUL or many raw control characters
TRUNCATED_JSON = "truncated_json"  # the start of a JSON document, cut short
INVALID_JSON = "invalid_json"  # any other parse error, NaN/Infinity, numbers out of range
DUPLICATE_KEY = "duplicate_key"  # an object with a key twice
INVALID_UNICODE = "invalid_unicode"  # a lone surrogate escape: no Unicode text
TOO_DEEP = "too_deep"  # nested over MAX_DEPTH levels
WRONG_TYPE = "wrong_type"  # a value of the wrong JSON type (null where a list is wanted...)
MISSING_FIELD = "missing_field"  # a required key is absent
OUT_OF_RANGE = "out_of_range"  # a negative duration, a share outside [0, 1]...
INVALID_VALUE = "invalid_value"  # an unknown language, two durations, both record shapes...
PROCESSING_ERROR = "processing_error"  # a record that failed in scrub/features/dedup/write
