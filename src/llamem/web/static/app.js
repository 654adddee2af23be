// The `llamem serve` page: controls drawn from /api/options, state in the URL's query string,
// charts redrawn from /api/estimate, /api/plan and /api/fits (the JSON `--json` prints).
"use strict";
(function () {
  const C = window.LlamemCharts;
  const $ = (id) => document.getElementById(id);
  const DEFAULTS = { model: "llama-3.1-8b", task: "lora", batch: "4", seq: "2048", gpu: "rtx-4090", gpus: "1" };
  const MAIN = ["precision", "ac", "optimizer", "lora-rank", "new-tokens", "quant"];
  const FIXED = ["model", "task", "batch", "seq", "gpu", "gpus"];
  const PLAN_ONLY_SHOWN = ["exact", "no-truncation", "host-memory"];
  const HIDDEN = ["override", "budget", "min-gpus", "maximize"];
  const MAX_UPLOAD_BYTES = 1024 * 1024;
  let options = { estimate: [], plan: [] };
  let state = {};
  let upload = null; // the parsed config.json object, when one was uploaded
  let sequence = 0;
  let lastPlanQuery = null;
  let lastFits = null, lastEstimate = null, lastPlan = null;

  function readState() {
    const params = new URLSearchParams(location.search);
    const s = Object.assign({}, DEFAULTS);
    for (const [k, v] of params) s[k] = k === "override" ? (s[k] || []).concat([v]) : v;
    return s;
  }

  // Query string of an object whose values are text or lists of text (--override repeats).
  function toParams(object) {
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries(object)) {
      for (const item of Array.isArray(v) ? v : [v]) if (item !== "" && item !== undefined) params.append(k, item);
    }
    return params.toString();
  }

  function writeUrl() {
    history.replaceState(null, "", "?" + toParams(state));
  }

  function names(command) { return options[command].map((o) => o.name); }

  function query(command) {
    const allowed = names(command);
    const q = {};
    for (const [k, v] of Object.entries(state)) {
      if (v === "" || v === undefined || v === "false") continue;
      if (command === "plan" && k === "engine") continue; // estimate's --engine; the plan searches every engine
      if (k === "model" || allowed.includes(k)) q[k] = v;
    }
    if (upload) delete q.model;
    return q;
  }

  async function call(route, q) {
    const init = upload
      ? { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(Object.assign({}, q, { config: upload })) }
      : { method: "GET" };
    const url = upload ? `/api/${route}` : `/api/${route}?` + toParams(q);
    const response = await fetch(url, init);
    return response.json();
  }

  function defaultOf(option) {
    const m = /\[default: ([^\]]+)\]/.exec(option.help || "");
    return m ? m[1] : "";
  }

  function suggestions(option) {
    const head = (option.help || "").split(/[.[]/)[0];
    return head.includes("|") ? head.split("|").map((s) => s.trim()).filter((s) => /^[\w.+-]+$/.test(s)) : [];
  }

  function control(option, parent) {
    const id = "opt-" + option.name;
    const container = document.createElement("div");
    container.className = option.kind === "flag" ? "knob wide" : "knob";
    parent.appendChild(container);
    if (option.kind === "flag") {
      const label = document.createElement("label");
      label.className = "check";
      const box = document.createElement("input");
      box.type = "checkbox"; box.id = id; box.name = option.name;
      box.checked = state[option.name] === "true";
      label.appendChild(box);
      label.appendChild(document.createTextNode("--" + option.name));
      label.title = option.help;
      container.appendChild(label);
      return;
    }
    const label = document.createElement("label");
    label.htmlFor = id; label.textContent = option.name.replace(/-/g, " "); label.title = option.help;
    container.appendChild(label);
    let input;
    if (option.kind === "choice") {
      input = document.createElement("select");
      input.appendChild(new Option("(default)", ""));
      for (const c of option.choices) input.appendChild(new Option(c, c));
    } else {
      input = document.createElement("input");
      if (option.kind === "int") { input.type = "number"; input.inputMode = "numeric"; }
      const words = suggestions(option);
      if (words.length) {
        const list = document.createElement("datalist");
        list.id = id + "-list";
        for (const w of words) list.appendChild(new Option(w, w));
        container.appendChild(list);
        input.setAttribute("list", list.id);
      }
      input.placeholder = defaultOf(option);
      input.spellcheck = false;
    }
    input.id = id; input.name = option.name; input.title = option.help;
    input.value = state[option.name] || "";
    container.appendChild(input);
  }

  function buildControls(models, gpus) {
    const modelList = $("model-list");
    for (const m of models) {
      const o = new Option(`${m.name}  (${(m.num_params / 1e9).toFixed(1)}B)`, m.name);
      modelList.appendChild(o);
    }
    const task = options.estimate.find((o) => o.name === "task");
    for (const c of task.choices) $("task").appendChild(new Option(c, c));
    const gpuSelect = $("gpu");
    for (const g of gpus) gpuSelect.appendChild(new Option(`${g.name} · ${C.gib(g.memory_bytes, 1)}`, g.name));
    for (const id of FIXED) $(id).value = state[id] || "";
    const main = $("main-knobs"), more = $("more-knobs");
    const estimateNames = names("estimate"), planNames = names("plan");
    for (const name of MAIN) {
      const o = options.estimate.find((x) => x.name === name);
      if (o) control(o, main);
    }
    const heading = (text) => { const h = document.createElement("h2"); h.className = "spaced wide"; h.textContent = text; more.appendChild(h); };
    heading("Workload");
    for (const o of options.estimate) {
      if (!FIXED.includes(o.name) && !MAIN.includes(o.name) && !HIDDEN.includes(o.name) && planNames.includes(o.name)) control(o, more);
    }
    heading("Estimate layout");
    for (const o of options.estimate) if (!planNames.includes(o.name) && !HIDDEN.includes(o.name)) control(o, more);
    heading("Planner");
    for (const o of options.plan) if (!estimateNames.includes(o.name) && PLAN_ONLY_SHOWN.includes(o.name)) control(o, more);
  }

  function onInput(event) {
    const t = event.target;
    if (!t.name) return;
    state[t.name] = t.type === "checkbox" ? (t.checked ? "true" : "") : t.value.trim();
    schedule();
  }

  let timer = null;
  function schedule() {
    writeUrl();
    clearTimeout(timer);
    timer = setTimeout(refresh, 120);
  }

  function showMessage(text, kind) {
    const box = $("message");
    box.hidden = !text;
    box.textContent = text || "";
    box.className = "message " + (kind || "error");
  }

  function capacity(gpus) {
    const g = gpus.find((x) => x.name === state.gpu);
    return g ? { bytes: g.memory_bytes, label: state.gpus && state.gpus !== "1" ? `${g.name} (each)` : g.name } : null;
  }

  async function refresh() {
    const mine = ++sequence;
    $("results").classList.add("busy");
    const planQuery = state.gpu ? Object.assign(query("plan"), { gpu: state.gpu }) : null;
    const [est, plan] = await Promise.all([call("estimate", query("estimate")),
      planQuery ? call("plan", planQuery) : Promise.resolve(null)]);
    if (mine !== sequence) return;
    $("results").classList.remove("busy");
    if (est.error) {
      showMessage(est.error.message);
      $("summary").replaceChildren();
      return;
    }
    showMessage(upload ? "Using the uploaded config.json (a link cannot carry it: upload it again to reproduce this view)." : "", "info");
    lastEstimate = est; lastPlan = plan && !plan.error ? plan : null;
    lastPlanQuery = planQuery;
    draw(plan);
    $("bundle").replaceChildren();
    const fits = await call("fits", query("estimate"));
    if (mine !== sequence) return;
    lastFits = fits.error ? null : fits;
    if (lastFits) C.fitsTable($("fits"), lastFits, state.gpu);
  }

  function draw(plan) {
    const cap = capacity(window.LLAMEM_GPUS || []);
    C.summary($("summary"), lastEstimate, cap, lastPlan);
    C.phaseBars($("phases"), lastEstimate, cap);
    if (plan && plan.error) {
      $("plan-title").textContent = "Plan";
      const p = document.createElement("p");
      p.className = "message error"; p.textContent = plan.error.message;
      $("plan").replaceChildren(p);
    } else if (lastPlan) {
      $("plan-title").textContent = lastPlan.fits
        ? `Plan: from ${C.gib(lastPlan.start.peak_device_bytes)} to ${C.gib(lastPlan.final.peak_device_bytes)} on ${lastPlan.num_gpus} × ${lastPlan.gpu.name}`
        : `Does not fit ${lastPlan.num_gpus} × ${lastPlan.gpu.name}: the closest plan is ${C.gib(lastPlan.shortfall_bytes)} short`;
      C.waterfall($("plan"), lastPlan);
    } else {
      $("plan-title").textContent = "Plan";
      $("plan").replaceChildren(document.createTextNode("Choose a GPU to plan for."));
    }
    commands();
  }

  function shown(command, q) {
    const parts = ["llamem", command];
    if (upload) parts.push("--config", "config.json");
    else if (q.model) parts.push(quote(q.model));
    for (const [k, v] of Object.entries(q)) {
      if (k === "model") continue;
      for (const item of Array.isArray(v) ? v : [v]) parts.push(item === "true" ? `--${k}` : `--${k} ${quote(item)}`);
    }
    return parts.join(" ");
  }

  function quote(text) { return /^[\w@%+=:,./-]+$/.test(text) ? text : "'" + text.replace(/'/g, "'\"'\"'") + "'"; }

  function codeBlock(title, text) {
    const wrap = document.createElement("div");
    const t = document.createElement("div"); t.className = "code-title"; t.textContent = title;
    const block = document.createElement("div"); block.className = "code-block";
    const pre = document.createElement("pre"); pre.textContent = text;
    const button = document.createElement("button");
    button.type = "button"; button.className = "copy"; button.textContent = "Copy";
    button.addEventListener("click", () => copy(text, button));
    block.append(pre, button);
    wrap.append(t, block);
    return wrap;
  }

  async function copy(text, button) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (err) {
      const area = document.createElement("textarea");
      area.value = text; document.body.appendChild(area); area.select();
      document.execCommand("copy"); area.remove();
    }
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1200);
  }

  function commands() {
    const box = $("commands");
    box.replaceChildren(codeBlock("This estimate", shown("estimate", query("estimate"))));
    if (lastPlanQuery) box.appendChild(codeBlock("This plan", shown("plan", lastPlanQuery)));
    if (lastPlan) {
      box.appendChild(codeBlock(lastPlan.fits ? "The configuration the plan ends on" : "The closest configuration", lastPlan.final.command));
      if (lastPlan.final.code) box.appendChild(codeBlock("Code that applies it (--code)", lastPlan.final.code));
    }
    $("bundle-box").hidden = !(lastPlan && lastPlan.fits);
  }

  async function showBundle() {
    const box = $("bundle");
    box.replaceChildren(document.createTextNode("Building the bundle…"));
    const answer = await call("emit", lastPlanQuery);
    if (answer.error || answer.message) {
      box.replaceChildren(document.createTextNode(answer.error ? answer.error.message : answer.message));
      return;
    }
    const tabs = document.createElement("div"); tabs.className = "tabs"; tabs.setAttribute("role", "tablist");
    const view = document.createElement("div");
    const files = Object.keys(answer.files);
    const select = (name) => {
      for (const b of tabs.children) b.setAttribute("aria-selected", String(b.textContent === name));
      view.replaceChildren(codeBlock(`${name} (${answer.strategy}, launched by ${answer.launcher}; the plan of ` +
        `--emit keeps only what the bundle runs: ${answer.command})`, answer.files[name]));
    };
    for (const name of files) {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = name; b.setAttribute("role", "tab");
      b.addEventListener("click", () => select(name));
      tabs.appendChild(b);
    }
    box.replaceChildren(tabs, view);
    select(files.includes("README.md") ? "README.md" : files[0]);
  }

  function readUpload(event) {
    const file = event.target.files[0];
    if (!file) return;
    if (file.size > MAX_UPLOAD_BYTES) {
      showMessage(`${file.name}: ${file.size.toLocaleString()} bytes is not a config.json (at most 1 MiB): pass the model's config.json`);
      return;
    }
    const reader = new FileReader();
    reader.onload = () => {
      let parsed;
      try {
        parsed = JSON.parse(reader.result);
      } catch (err) {
        showMessage(`${file.name}: not valid JSON (${err.message}): pass the model's config.json`);
        event.target.value = "";
        return;
      }
      upload = parsed;
      $("upload-name").textContent = `${file.name} uploaded`;
      $("model").disabled = true;
      addClear();
      schedule();
    };
    reader.readAsText(file);
  }

  function addClear() {
    const clear = document.createElement("button");
    clear.type = "button"; clear.textContent = "Clear"; clear.className = "secondary"; clear.id = "upload-clear";
    clear.addEventListener("click", () => {
      upload = null; $("upload").value = ""; $("upload-name").textContent = ""; $("model").disabled = false;
      clear.remove(); schedule();
    });
    $("upload-name").appendChild(document.createTextNode(" ")); $("upload-name").appendChild(clear);
  }

  async function start() {
    state = readState();
    const [opts, models, gpus] = await Promise.all([fetch("/api/options").then((r) => r.json()),
      fetch("/api/models").then((r) => r.json()), fetch("/api/gpus").then((r) => r.json())]);
    const failed = [opts, models, gpus].find((answer) => answer.error);
    if (failed) {
      showMessage(failed.error.message + " (reload the page to try again)");
      return;
    }
    options = opts;
    window.LLAMEM_GPUS = gpus;
    buildControls(models, gpus);
    $("controls").addEventListener("input", onInput);
    $("controls").addEventListener("change", onInput);
    $("controls").addEventListener("submit", (e) => e.preventDefault());
    $("upload-button").addEventListener("click", () => $("upload").click());
    $("upload").addEventListener("change", readUpload);
    $("bundle-button").addEventListener("click", showBundle);
    let width = window.innerWidth;
    window.addEventListener("resize", () => {
      if (Math.abs(window.innerWidth - width) < 20 || !lastEstimate) return;
      width = window.innerWidth;
      draw(lastPlan);
      if (lastFits) C.fitsTable($("fits"), lastFits, state.gpu);
    });
    writeUrl();
    refresh();
  }

  start();
})();
