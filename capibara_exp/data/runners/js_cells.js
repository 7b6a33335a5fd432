// Sandbox runner: execute JavaScript cells in node's vm, one JSON line per cell.
// Reads {"cells": [{"id", "code", "reset"}], "timeout_s"} on stdin. The value of a cell's
// last expression is its main result; console output is its stdout/stderr lines.
"use strict";
const fs = require("fs");
const path = require("path");
const util = require("util");
const vm = require("vm");
const { createRequire } = require("module");

const MAX_TEXT = 20000;
const request = JSON.parse(fs.readFileSync(0, "utf8"));
const timeoutMs = Math.max(1, Math.round(request.timeout_s * 1000));
let context = null;
let count = 0;

function freshContext(stdout, stderr) {
  const put = (sink) => (...args) => sink.push(util.format(...args) + "\n");
  const con = { log: put(stdout), info: put(stdout), debug: put(stdout), dir: put(stdout),
                table: put(stdout), warn: put(stderr), error: put(stderr), trace: put(stderr) };
  return vm.createContext({ console: con, require: createRequire(path.join(process.cwd(), "cell.js")),
                            Buffer, URL, URLSearchParams, TextEncoder, TextDecoder,
                            setTimeout, clearTimeout, setInterval, clearInterval,
                            module: { exports: {} }, exports: {} });
}

for (const cell of request.cells) {
  const stdout = [];
  const stderr = [];
  if (context === null || cell.reset) {
    context = freshContext(stdout, stderr);
    count = 0;
  } else {
    const put = (sink) => (...args) => sink.push(util.format(...args) + "\n");
    Object.assign(context.console, { log: put(stdout), info: put(stdout), warn: put(stderr),
                                     error: put(stderr) });
  }
  count += 1;
  const results = [];
  let error = null;
  const started = new Date().toISOString();
  const t0 = process.hrtime.bigint();
  try {
    const value = vm.runInContext(cell.code, context, { timeout: timeoutMs, filename: "cell.js" });
    if (value !== undefined) {
      results.push({ text: util.inspect(value).slice(0, MAX_TEXT), is_main_result: true });
    }
  } catch (e) {
    const name = e && e.name ? String(e.name) : "Error";
    error = { name, value: String(e && e.message !== undefined ? e.message : e).slice(0, MAX_TEXT),
              traceback: String(e && e.stack ? e.stack : e).slice(0, MAX_TEXT) };
  }
  const ms = Number(process.hrtime.bigint() - t0) / 1e6;
  process.stdout.write(JSON.stringify({ id: cell.id, results, stdout, stderr, error,
                                        execution_count: count, duration_ms: ms,
                                        started_at: started }) + "\n");
}
