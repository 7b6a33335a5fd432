// Sandbox runner: execute JavaScript cells in node's vm, one JSON line per cell.
// Reads {"cells": [{"id", "code", "reset"}], "timeout_s", "check_only"} on stdin. The value
// of a cell's last expression is its main result; console output is its stdout/stderr lines. A cell
// with import/export or top-level await runs as an ES module (as a notebook's JS kernel
// would), its imports served by node's require from the sandbox's NODE_PATH.
"use strict";
const fs = require("fs");
const path = require("path");
const util = require("util");
const vm = require("vm");
const { createRequire } = require("module");

const MAX_TEXT = 20000;
const ESM = /^\s*(import\s+[\w*{]|import\s*['"]|export\s|await\s)/m;
const request = JSON.parse(fs.readFileSync(0, "utf8"));
// A cell's stray async failure (a promise rejected after the cell returned) must not end
// the process and lose the cells after it; it only shows on stderr, as in a notebook.
process.on("unhandledRejection", (e) => process.stderr.write(`unhandled rejection: ${e}\n`));
process.on("uncaughtException", (e) => process.stderr.write(`uncaught exception: ${e}\n`));
const timeoutMs = Math.max(1, Math.round(request.timeout_s * 1000));

function freshContext() {
  const sinks = { stdout: [], stderr: [] };
  const put = (name) => (...args) => sinks[name].push(util.format(...args) + "\n");
  const con = { log: put("stdout"), info: put("stdout"), debug: put("stdout"), dir: put("stdout"),
                table: put("stdout"), warn: put("stderr"), error: put("stderr"), trace: put("stderr") };
  const context = vm.createContext({
    console: con, require: createRequire(path.join(process.cwd(), "cell.js")),
    Buffer, URL, URLSearchParams, TextEncoder, TextDecoder, setTimeout, clearTimeout,
    setInterval, clearInterval, module: { exports: {} }, exports: {} });
  return { context, sinks };
}

function linker(context) {
  return async (specifier) => {
    const exported = context.require(specifier);
    const names = Object.keys(exported ?? {}).filter((k) => k !== "default");
    return new vm.SyntheticModule(["default", ...names], function () {
      this.setExport("default", exported);
      for (const k of names) this.setExport(k, exported[k]);
    }, { context });
  };
}

async function runModule(code, context) {
  const mod = new vm.SourceTextModule(code, { context, identifier: "cell.mjs" });
  await mod.link(linker(context));
  let timer;
  const limit = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`cell exceeded ${timeoutMs} ms`)), timeoutMs);
  });
  try {
    await Promise.race([mod.evaluate({ timeout: timeoutMs }), limit]);
  } finally {
    clearTimeout(timer);
  }
  return undefined; // a module has no completion value
}

function errorOf(e) {
  const name = e && e.name ? String(e.name) : "Error";
  return { name, value: String(e && e.message !== undefined ? e.message : e).slice(0, MAX_TEXT),
           traceback: String(e && e.stack ? e.stack : e).slice(0, MAX_TEXT) };
}

// check_only: compile each cell as it would run (module or script) without running it,
// one line per cell with its syntax error or null.
function checkSyntax() {
  const context = vm.createContext({});
  for (const cell of request.cells) {
    let error = null;
    try {
      if (ESM.test(cell.code) && vm.SourceTextModule) {
        new vm.SourceTextModule(cell.code, { context, identifier: "cell.mjs" });
      } else {
        new vm.Script(cell.code, { filename: "cell.js" });
      }
    } catch (e) {
      error = errorOf(e);
    }
    process.stdout.write(JSON.stringify({ id: cell.id, syntax_error: error }) + "\n");
  }
}

async function main() {
  if (request.check_only) return checkSyntax();
  let state = null;
  let count = 0;
  for (const cell of request.cells) {
    if (state === null || cell.reset) {
      state = freshContext();
      count = 0;
    }
    state.sinks.stdout = [];
    state.sinks.stderr = [];
    count += 1;
    const results = [];
    let error = null;
    const started = new Date().toISOString();
    const t0 = process.hrtime.bigint();
    try {
      const value = ESM.test(cell.code) && vm.SourceTextModule
        ? await runModule(cell.code, state.context)
        : vm.runInContext(cell.code, state.context, { timeout: timeoutMs, filename: "cell.js" });
      if (value !== undefined) {
        results.push({ text: util.inspect(value).slice(0, MAX_TEXT), is_main_result: true });
      }
    } catch (e) {
      error = errorOf(e);
    }
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    process.stdout.write(JSON.stringify({ id: cell.id, results, stdout: state.sinks.stdout,
                                          stderr: state.sinks.stderr, error,
                                          execution_count: count, duration_ms: ms,
                                          started_at: started }) + "\n");
  }
}

main().then(() => process.exit(0), (e) => { process.stderr.write(String(e && e.stack)); process.exit(1); });
