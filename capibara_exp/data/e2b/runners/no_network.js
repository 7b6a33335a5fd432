// Preloaded (`node --require`) where the sandbox cannot cut the network with a namespace:
// every public way to open a connection or resolve a name throws, as Python's runners get a
// socket module that refuses to connect. In-process only: a child process is not covered.
"use strict";
const refuse = (what) => function () {
  const err = new Error(`network access is disabled in this sandbox (${what})`);
  err.code = "ENETUNREACH";
  throw err;
};
const net = require("net");
net.Socket.prototype.connect = refuse("net.Socket.connect");
net.connect = net.createConnection = refuse("net.connect");
const dgram = require("dgram");
for (const m of ["send", "connect"]) dgram.Socket.prototype[m] = refuse(`dgram.Socket.${m}`);
const dns = require("dns");
const lookups = ["lookup", "lookupService", "resolve", "resolve4", "resolve6", "resolveAny",
  "resolveCname", "resolveMx", "resolveNs", "resolveTxt", "resolveSrv", "resolvePtr",
  "resolveNaptr", "resolveSoa", "resolveCaa", "reverse"];
for (const m of lookups) {
  if (typeof dns[m] === "function") dns[m] = refuse(`dns.${m}`);
  if (dns.promises && typeof dns.promises[m] === "function") dns.promises[m] = refuse(`dns.${m}`);
  if (dns.Resolver && typeof dns.Resolver.prototype[m] === "function") {
    dns.Resolver.prototype[m] = refuse(`dns.Resolver.${m}`);
  }
}
globalThis.fetch = refuse("fetch");
for (const name of ["WebSocket", "EventSource"]) {
  if (name in globalThis) globalThis[name] = refuse(name);
}
const binding = process.binding;
const wraps = new Set(["tcp_wrap", "udp_wrap", "cares_wrap", "pipe_wrap"]);
process.binding = function (name) {
  if (wraps.has(name)) refuse(`process.binding('${name}')`)();
  return binding.call(process, name);
};
