/* Babelcast caption overlay: /overlay/{stream}?lang=xx[&lang2=yy][&...]
 *
 * URL parameters (all optional except lang, which the gateway fills in):
 *   lang     caption language           lang2   a second language, shown below the first
 *   size     font size in px (40)       size2   font size of lang2 (size)
 *   color    text colour (ffffff)       color2  text colour of lang2 (ffe680)
 *   bg       box behind the lines, e.g. 000000b0 or rgba(0,0,0,.7) (none: outlined text)
 *   outline  1/0: dark outline around the text (1 without bg, 0 with bg)
 *   lines    lines shown per language (2)
 *   chars    characters per line (42)    align   left (default) or center
 *   font     a locally installed font family
 *   hide     clear the lines after this many seconds without captions (0: never)
 *   stale    seconds after which a lost connection or an old saved state is stale (30)
 *   since    seq to start from when this browser has no saved position (default: live)
 *   debug    1: show the connection state in the top-left corner
 *   token    the viewer token (from the gateway's front page or `babelcast token`); it is
 *            sent as the WebSocket subprotocol `bearer.TOKEN`, not in the socket's URL
 * Colours are hex without '#' (ff0000, ff000080), or any CSS colour (red, rgb(…)).
 *
 * Each language keeps its position (last seq) and what it shows in localStorage, so a
 * reload (OBS reloads a browser source on every scene switch) shows the same lines and
 * resumes with `since`: nothing is repeated or skipped. A position older than `stale`
 * is dropped, and so is the screen after a disconnect longer than `stale`: the overlay
 * then starts again at the live edge rather than replaying minutes of old captions.
 */
(function () {
  "use strict";

  var params = new URLSearchParams(location.search);
  var LB = window.BABELCAST_LINEBREAK || { weak: {}, punctEnd: [], glueBack: "", glueForward: "" };
  var KEEP = 20; // segments kept (and saved) per language: more than any screen shows

  function num(name, dflt, lo, hi) {
    var raw = params.get(name);
    if (raw === null || raw === "") return dflt;
    var v = Number(raw);
    if (!isFinite(v) || v < lo || v > hi) {
      console.warn("babelcast overlay: " + name + " must be a number in " + lo + ".." + hi);
      return dflt;
    }
    return v;
  }

  function colour(name, dflt) {
    var raw = params.get(name);
    if (!raw) return dflt;
    var candidates = /^[0-9a-fA-F]{3,8}$/.test(raw) ? ["#" + raw, raw] : [raw];
    for (var i = 0; i < candidates.length; i++) {
      if (CSS.supports("color", candidates[i])) return candidates[i];
    }
    console.warn("babelcast overlay: " + name + " is not a colour");
    return dflt;
  }

  var path = location.pathname.replace(/\/+$/, "").split("/");
  var stream = decodeURIComponent(path[path.length - 1]);
  var size = num("size", 40, 6, 400);
  var cfg = {
    lang: params.get("lang") || "",
    lang2: params.get("lang2") || "",
    size: size,
    size2: num("size2", size, 6, 400),
    color: colour("color", "#ffffff"),
    color2: colour("color2", "#ffe680"),
    bg: colour("bg", ""),
    lines: Math.round(num("lines", 2, 1, 12)),
    chars: Math.round(num("chars", 42, 8, 200)),
    font: params.get("font") || "",
    align: params.get("align") === "center" ? "center" : "left",
    hide: num("hide", 0, 0, 86400),
    stale: num("stale", 30, 1, 86400),
    since: params.get("since"),
    token: params.get("token") || "",
    debug: params.get("debug") === "1"
  };
  cfg.outline = params.has("outline") ? params.get("outline") !== "0" : !cfg.bg;

  // ---- line breaking: the same rules as workers/captions/linebreak.py -------------
  function onlyOf(token, chars) {
    if (!token) return false;
    for (var i = 0; i < token.length; i++) if (chars.indexOf(token[i]) < 0) return false;
    return true;
  }

  function units(text, width) {
    var out = [];
    var glueNext = false;
    var tokens = text.split(/\s+/).filter(Boolean);
    for (var i = 0; i < tokens.length; i++) {
      var tok = tokens[i];
      var last = out.length ? out[out.length - 1] : null;
      var fits = last !== null && last.length + 1 + tok.length <= width;
      if (fits && (glueNext || onlyOf(tok, LB.glueBack))) out[out.length - 1] = last + " " + tok;
      else out.push(tok);
      glueNext = onlyOf(tok, LB.glueForward);
    }
    return out;
  }

  function wrap(text, width, weak) {
    var words = units(text, width);
    var lines = [];
    var i = 0;
    while (i < words.length) {
      var length = 0;
      var cands = [];
      for (var j = i; j < words.length; j++) {
        length += words[j].length + (j > i ? 1 : 0);
        if (length > width) break;
        cands.push(j + 1);
      }
      if (!cands.length) { // one word longer than a line
        var w = words[i];
        lines.push(w.slice(0, width));
        if (w.length > width) words[i] = w.slice(width); else i++;
        continue;
      }
      var lastCand = cands[cands.length - 1];
      if (lastCand === words.length) { lines.push(words.slice(i).join(" ")); break; }
      var best = lastCand;
      var bestScore = -Infinity;
      var full = words.slice(i, lastCand).join(" ").length;
      for (var c = 0; c < cands.length; c++) {
        var end = cands[c];
        var lineLen = words.slice(i, end).join(" ").length;
        if (lineLen < 0.6 * full) continue;
        var unit = words[end - 1];
        var lastWord = unit.slice(unit.lastIndexOf(" ") + 1);
        var score = lineLen / width;
        if (LB.punctEnd.some(function (p) { return lastWord.endsWith(p); })) score += 0.5;
        if (weak.has(lastWord.toLowerCase())) score -= 1.0;
        if (score > bestScore) { best = end; bestScore = score; }
      }
      lines.push(words.slice(i, best).join(" "));
      i = best;
    }
    return lines;
  }

  function weakWords(lang) {
    var base = (lang || "en").split("-")[0].toLowerCase();
    return new Set(LB.weak[base] || LB.weak.en || []);
  }

  // ---- one language: its socket, its segments, its lines ---------------------------
  function Track(lang, el, color, fontSize) {
    this.lang = lang;
    this.el = el;
    this.key = "babelcast:overlay:" + stream + ":" + lang;
    this.weak = weakWords(lang);
    this.segments = []; // {id, text, final, error}, in the order of first publication
    this.finalIds = new Set(); // segments already shown as final: never shown again
    this.finalOrder = [];
    this.lastSeq = 0;
    this.lastMsgAt = 0;
    this.liveEdge = true; // no position: connect without since
    this.ws = null;
    this.attempt = 0;
    this.immediate = false;
    this.disconnectedAt = null;
    this.retryTimer = null;
    this.staleTimer = null;
    this.hideTimer = null;
    el.className = "track";
    el.dataset.lang = lang;
    el.style.setProperty("--lines", String(cfg.lines));
    el.style.fontSize = fontSize + "px";
    el.style.color = color;
  }

  Track.prototype.setState = function (state, detail) {
    this.el.dataset.state = state;
    if (cfg.debug) {
      var status = document.getElementById("status");
      status.hidden = false;
      status.textContent = this.lang + ": " + state + (detail ? " (" + detail + ")" : "");
    }
  };

  Track.prototype.rememberFinal = function (id) {
    if (this.finalIds.has(id)) return;
    this.finalIds.add(id);
    this.finalOrder.push(id);
    if (this.finalOrder.length > 1000) this.finalIds.delete(this.finalOrder.shift());
  };

  Track.prototype.restore = function () {
    var st = null;
    try { st = JSON.parse(localStorage.getItem(this.key) || "null"); } catch (e) { st = null; }
    if (!st || st.v !== 1 || Date.now() - (st.aliveAt || 0) > cfg.stale * 1000) {
      // Nothing saved, or saved too long ago to be worth replaying: start live (or at
      // the `since` the URL asks for).
      localStorage.removeItem(this.key);
      if (cfg.since !== null && /^\d+$/.test(cfg.since)) {
        this.lastSeq = Number(cfg.since);
        this.liveEdge = false;
      }
      return;
    }
    this.lastSeq = st.lastSeq | 0;
    this.lastMsgAt = st.lastMsgAt || 0;
    this.segments = Array.isArray(st.segments) ? st.segments : [];
    this.liveEdge = false;
    for (var i = 0; i < this.segments.length; i++) {
      if (this.segments[i].final) this.rememberFinal(this.segments[i].id);
    }
    this.armHide();
  };

  Track.prototype.save = function () {
    try {
      if (this.liveEdge) { localStorage.removeItem(this.key); return; }
      localStorage.setItem(this.key, JSON.stringify({
        v: 1, lastSeq: this.lastSeq, lastMsgAt: this.lastMsgAt, aliveAt: Date.now(),
        segments: this.segments.slice(-KEEP)
      }));
    } catch (e) { /* storage full or disabled: the overlay still works, without resume */ }
  };

  Track.prototype.connect = function () {
    clearTimeout(this.retryTimer);
    var q = new URLSearchParams({ lang: this.lang });
    if (!this.liveEdge) q.set("since", String(this.lastSeq));
    var proto = location.protocol === "https:" ? "wss:" : "ws:";
    var url = proto + "//" + location.host + "/v1/streams/" + encodeURIComponent(stream) +
      "/captions?" + q.toString();
    var self = this;
    // Browsers set no headers on a WebSocket: the token rides as a subprotocol.
    var ws = cfg.token ? new WebSocket(url, ["babelcast", "bearer." + cfg.token])
      : new WebSocket(url);
    this.ws = ws;
    this.setState("connecting");
    ws.onopen = function () {
      self.attempt = 0;
      self.disconnectedAt = null;
      clearTimeout(self.staleTimer);
      self.setState("live");
    };
    ws.onmessage = function (ev) {
      var msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      if (msg.type === "error") self.onError(msg);
      else if (msg.type === "caption") self.onCaption(msg);
      else if (msg.type === "withdraw") self.onWithdraw(msg);
    };
    ws.onclose = function () {
      if (self.ws !== ws) return;
      self.ws = null;
      self.onDisconnect();
    };
  };

  Track.prototype.onError = function (msg) {
    if (msg.code === "slow_client" || msg.code === "unavailable") {
      this.immediate = true; // reconnect with since at once: nothing is lost
      return;
    }
    if (msg.code === "since_ahead") {
      // The stream's captions started over (a new event): our position means nothing.
      this.goLive();
      this.immediate = true;
      return;
    }
    console.warn("babelcast overlay: " + msg.code + ": " + msg.message);
    // Kept until captions flow again: the state itself turns to "connecting" at once.
    // (unauthorized / token_expired: the URL needs a new token.)
    this.el.dataset.error = msg.code;
    this.setState("error", msg.code);
    this.attempt = 8; // a wrong stream or language: retry rarely
  };

  Track.prototype.onCaption = function (msg) {
    if (typeof msg.seq !== "number" || msg.seq <= this.lastSeq) return; // seen already
    delete this.el.dataset.error;
    this.lastSeq = msg.seq;
    this.lastMsgAt = Date.now();
    this.liveEdge = false;
    if (!this.finalIds.has(msg.segment_id)) { // a final is never revised nor repeated
      var seg = null;
      for (var i = this.segments.length - 1; i >= 0; i--) {
        if (this.segments[i].id === msg.segment_id) { seg = this.segments[i]; break; }
      }
      if (seg === null) {
        seg = { id: msg.segment_id };
        this.segments.push(seg);
        if (this.segments.length > KEEP) this.segments.splice(0, this.segments.length - KEEP);
      }
      seg.text = msg.text || "";
      seg.final = !!msg.is_final;
      seg.error = msg.error || null;
      if (seg.final) this.rememberFinal(seg.id);
      this.render();
    }
    this.save();
    this.armHide();
  };

  // An interim the engine never confirmed (its session was replaced or ended): it leaves
  // the screen, and its segment id is closed like a final's, so nothing brings it back.
  Track.prototype.onWithdraw = function (msg) {
    if (typeof msg.seq !== "number" || msg.seq <= this.lastSeq) return; // seen already
    this.lastSeq = msg.seq;
    this.lastMsgAt = Date.now();
    this.liveEdge = false;
    if (!this.finalIds.has(msg.segment_id)) {
      this.segments = this.segments.filter(function (s) { return s.id !== msg.segment_id; });
      this.rememberFinal(msg.segment_id);
    }
    this.render();
    this.save();
  };

  Track.prototype.onDisconnect = function () {
    var self = this;
    this.setState("connecting");
    if (this.disconnectedAt === null) {
      this.disconnectedAt = Date.now();
      this.staleTimer = setTimeout(function () { self.goLive(); }, cfg.stale * 1000);
    }
    var delay = this.immediate ? 0 :
      Math.min(10000, 500 * Math.pow(2, this.attempt)) * (0.8 + 0.4 * Math.random());
    this.immediate = false;
    this.attempt = Math.min(this.attempt + 1, 8);
    this.retryTimer = setTimeout(function () { self.connect(); }, delay);
  };

  // Forget the screen and the position: what follows comes from the live edge.
  Track.prototype.goLive = function () {
    this.segments = [];
    this.lastSeq = 0;
    this.liveEdge = true;
    this.render();
    this.save();
  };

  Track.prototype.armHide = function () {
    var self = this;
    clearTimeout(this.hideTimer);
    if (cfg.hide <= 0) return;
    var left = cfg.hide * 1000 - (Date.now() - this.lastMsgAt);
    this.hideTimer = setTimeout(function () {
      self.segments = [];
      self.render();
      self.save();
    }, Math.max(0, left));
  };

  Track.prototype.render = function () {
    var out = [];
    for (var k = this.segments.length - 1; k >= 0 && out.length < cfg.lines; k--) {
      var s = this.segments[k];
      if (s.error || !s.text) continue;
      var ls = wrap(s.text, cfg.chars, this.weak);
      for (var m = ls.length - 1; m >= 0 && out.length < cfg.lines; m--) {
        out.unshift({ text: ls[m], interim: !s.final, seg: s.id });
      }
    }
    var nodes = out.map(function (l) {
      var div = document.createElement("div");
      div.className = l.interim ? "line interim" : "line";
      div.dataset.segment = String(l.seg);
      var span = document.createElement("span");
      span.textContent = l.text;
      if (cfg.bg) span.style.backgroundColor = cfg.bg;
      div.appendChild(span);
      return div;
    });
    this.el.replaceChildren.apply(this.el, nodes);
    this.el.dataset.lastSeq = String(this.lastSeq);
  };

  // ---- page -------------------------------------------------------------------------
  var root = document.getElementById("captions");
  if (cfg.align === "center") root.classList.add("center");
  if (cfg.outline) root.classList.add("outlined");
  if (cfg.font) root.style.fontFamily = cfg.font;
  if (!cfg.lang) {
    console.warn("babelcast overlay: no lang parameter");
    return;
  }

  var tracks = [[cfg.lang, cfg.color, cfg.size]];
  if (cfg.lang2 && cfg.lang2 !== cfg.lang) tracks.push([cfg.lang2, cfg.color2, cfg.size2]);
  tracks = tracks.map(function (t) {
    var el = document.createElement("div");
    root.appendChild(el);
    var track = new Track(t[0], el, t[1], t[2]);
    track.restore();
    track.render();
    track.connect();
    return track;
  });

  // Keep the saved position fresh while connected (and on unload), so a reload knows
  // it was live a moment ago and resumes instead of starting at the live edge.
  function saveAll() {
    tracks.forEach(function (t) { if (t.ws && t.ws.readyState === WebSocket.OPEN) t.save(); });
  }
  setInterval(saveAll, 5000);
  window.addEventListener("pagehide", saveAll);
})();
