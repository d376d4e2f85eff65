// Unbroken: small page helpers shared by every page (no inline scripts; CSP-friendly).
// - confirmation dialogs for operator forms (progressive: the server asks again without JS)
// - age tickers ("12 s ago") computed from timestamps, so unchanged data is never re-fetched
// - the Kubernetes fieldset on the new-job form shows only for that backend
// - the jobs list follows live with a cursor poll
(function () {
  "use strict";
  const U = (window.Unbroken = window.Unbroken || {});
  U.clockOffset = 0; // server ms - client ms, refreshed by every live poll
  U.serverNow = function () { return Date.now() + U.clockOffset; };

  U.fmtAge = function (ms) {
    const s = Math.max(0, ms / 1000);
    if (s < 10) return s.toFixed(1) + " s";
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return Math.round(s / 86400) + " d";
  };

  function tickAges() {
    const now = U.serverNow();
    document.querySelectorAll("[data-age-since]").forEach(function (el) {
      const since = Number(el.dataset.ageSince);
      if (since) el.textContent = U.fmtAge(now - since);
    });
  }
  setInterval(tickAges, 1000);

  // -- confirmation dialog --------------------------------------------------------------------
  let dialog = null;
  let pending = null;

  function ensureDialog() {
    if (dialog) return dialog;
    dialog = document.createElement("dialog");
    dialog.className = "confirm-dialog";
    dialog.setAttribute("aria-labelledby", "confirm-title");
    dialog.innerHTML =
      '<h2 id="confirm-title">Please confirm</h2><p class="confirm-message"></p><p class="confirm-detail sub"></p>' +
      '<div class="actions"><button type="button" class="primary" data-confirm-ok>Confirm</button>' +
      '<button type="button" data-confirm-cancel>Cancel</button></div>';
    document.body.appendChild(dialog);
    dialog.querySelector("[data-confirm-cancel]").addEventListener("click", function () {
      pending = null;
      dialog.close();
    });
    dialog.querySelector("[data-confirm-ok]").addEventListener("click", function () {
      const form = pending;
      pending = null;
      dialog.close();
      if (!form) return;
      let input = form.querySelector('input[name="confirmed"]');
      if (!input) {
        input = document.createElement("input");
        input.type = "hidden";
        input.name = "confirmed";
        form.appendChild(input);
      }
      input.value = "yes";
      form.submit();
    });
    return dialog;
  }

  function describe(form) {
    const parts = [];
    form.querySelectorAll("select").forEach(function (sel) {
      const label = form.querySelector('label[for="' + sel.id + '"]');
      const opt = sel.options[sel.selectedIndex];
      if (opt) parts.push((label ? label.textContent.trim() + " " : "") + opt.textContent.trim());
    });
    return parts.join(" · ");
  }

  document.addEventListener("submit", function (e) {
    const form = e.target;
    if (!(form instanceof HTMLFormElement) || !form.hasAttribute("data-confirm")) return;
    e.preventDefault();
    if (typeof HTMLDialogElement !== "function") {
      // No <dialog>: let the server's confirmation page ask.
      form.submit();
      return;
    }
    const d = ensureDialog();
    d.querySelector(".confirm-message").textContent = form.dataset.confirm;
    d.querySelector(".confirm-detail").textContent = describe(form);
    d.querySelector("[data-confirm-ok]").className = form.hasAttribute("data-danger") ? "danger" : "primary";
    pending = form;
    d.showModal();
  });

  // -- new-job form: backend-specific fieldsets -------------------------------------------------
  function syncBackend() {
    const sel = document.querySelector('select[name="backend"]');
    if (!sel) return;
    document.querySelectorAll("[data-show-for-backend]").forEach(function (fs) {
      fs.hidden = fs.dataset.showForBackend !== sel.value;
    });
  }
  document.addEventListener("change", function (e) {
    if (e.target && e.target.name === "backend") syncBackend();
  });

  // -- live indicator ----------------------------------------------------------------------------
  U.lastLiveOk = Date.now();
  U.markLive = function (ok) {
    if (ok) U.lastLiveOk = Date.now();
    const stale = Date.now() - U.lastLiveOk > 3000;
    document.querySelectorAll("[data-live-indicator]").forEach(function (el) {
      el.classList.toggle("stale", stale);
      el.textContent = stale ? "reconnecting…" : "live";
    });
  };

  // -- jobs list: cursor poll, re-fetch the table only when it changed ---------------------------
  function followJobsList(section) {
    let cursor = section.dataset.cursor;
    const page = section.dataset.page || "1";
    async function poll() {
      try {
        const r = await fetch(section.dataset.liveList + "?page=" + page + "&c=" + encodeURIComponent(cursor),
          { credentials: "same-origin", cache: "no-store" });
        if (r.ok) {
          const j = await r.json();
          if (j.changed.length) {
            const t = await fetch(section.dataset.livePart + "?page=" + page, { credentials: "same-origin", cache: "no-store" });
            if (t.ok) {
              section.innerHTML = await t.text();
              cursor = j.cursor;
            }
          } else {
            cursor = j.cursor;
          }
          U.markLive(true);
        } else {
          U.markLive(false);
        }
      } catch (err) {
        U.markLive(false);
      }
      setTimeout(poll, 1000);
    }
    setTimeout(poll, 1000);
  }

  // -- flash messages: a success note ("Job #N created") has said its piece once it has been read;
  // it leaves after a few seconds, every note has a close button, errors stay until closed.
  function setupMessages() {
    document.querySelectorAll(".messages .msg").forEach(function (el) {
      const close = document.createElement("button");
      close.type = "button";
      close.className = "link msg-close";
      close.setAttribute("aria-label", "dismiss");
      close.textContent = "×";
      close.addEventListener("click", function () { el.remove(); });
      el.appendChild(close);
      if (el.classList.contains("msg-success") || el.classList.contains("msg-info")) {
        setTimeout(function () { el.remove(); }, 6000);
      }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    setupMessages();
    syncBackend();
    tickAges();
    const list = document.querySelector("[data-live-list]");
    if (list) followJobsList(list);
  });
})();
