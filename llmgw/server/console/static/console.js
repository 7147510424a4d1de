// The llmgw console's only script: live parts of a page re-fetched as HTML fragments
// (what the operator typed into one kept), the confirmation of actions, copy buttons, a
// choice that follows another, and the Events page's live rows (server-sent events).
// No inline script, no eval, no third-party code: it runs under the console's CSP
// (default-src 'self'). Every page works without it.
(function () {
  "use strict";

  var MAX_ROWS = 500;

  function refreshSeconds() {
    var s = parseInt(document.body.getAttribute("data-refresh-s") || "5", 10);
    return isNaN(s) || s < 1 ? 5 : s;
  }

  function fragmentUrl(name) {
    var params = new URLSearchParams(window.location.search);
    params.set("fragment", name);
    return window.location.pathname + "?" + params.toString();
  }

  // -- live fragments -------------------------------------------------------------------
  // What the operator typed into a live part's fields, by id, so that a refresh does not
  // wipe a half-typed fingerprint.
  function typedValues(el) {
    var kept = {};
    Array.prototype.forEach.call(el.querySelectorAll("input[id], textarea[id]"), function (f) {
      if (f.type !== "hidden" && f.type !== "password" && f.value) {
        kept[f.id] = f.value;
      }
    });
    return kept;
  }

  function restoreValues(el, kept) {
    Object.keys(kept).forEach(function (id) {
      var f = document.getElementById(id);
      if (f && el.contains(f) && !f.value) {
        f.value = kept[id];
      }
    });
  }

  function replaceLive(el, html) {
    var kept = typedValues(el);
    el.innerHTML = html; // server-rendered, every value escaped there
    restoreValues(el, kept);
    bindConfirms(el);
    markScrollers();
  }

  function refreshLive() {
    if (document.hidden) {
      return;
    }
    var parts = document.querySelectorAll("[data-live]");
    Array.prototype.forEach.call(parts, function (el) {
      var name = el.getAttribute("data-live");
      var active = document.activeElement;
      if (active && active !== document.body && el.contains(active) &&
          (active.tagName === "INPUT" || active.tagName === "TEXTAREA")) {
        return; // the operator is typing here: the next round refreshes it
      }
      // A part may name its own URL (a POST's answer page has no query to add to).
      fetch(el.getAttribute("data-live-url") || fragmentUrl(name), {
        credentials: "same-origin",
        headers: { "Accept": "text/html" },
        redirect: "follow",
      })
        .then(function (response) {
          if (response.redirected || response.url.indexOf("/ui/login") >= 0) {
            window.location.reload(); // the session ended: the page goes to the login
            return null;
          }
          if (!response.ok) {
            return null; // keep what is shown; the next round tries again
          }
          return response.text();
        })
        .then(function (html) {
          if (html !== null && html !== undefined) {
            replaceLive(el, html);
          }
        })
        .catch(function () {
          // offline for a moment: the next round tries again
        });
    });
  }

  function startLive() {
    if (!document.querySelector("[data-live]")) {
      return;
    }
    window.setInterval(refreshLive, refreshSeconds() * 1000);
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden) {
        refreshLive();
      }
    });
  }

  // -- wide tables ----------------------------------------------------------------------
  // A .scroll box whose table is wider than the box names the side(s) where columns hide
  // (data-more: right, left or both), which the style fades: on a phone, the cue that it
  // scrolls sideways. Such a box takes the keyboard's focus, so that arrows scroll it too.
  function markScroller(box) {
    var hidden = box.scrollWidth - box.clientWidth;
    var more = "";
    if (hidden > 1) {
      var left = box.scrollLeft > 1;
      var right = box.scrollLeft < hidden - 1;
      more = left && right ? "both" : (left ? "left" : "right");
    }
    if (more) {
      box.setAttribute("data-more", more);
      if (!box.hasAttribute("tabindex")) {
        box.setAttribute("tabindex", "0");
      }
    } else if (box.hasAttribute("data-more")) {
      box.removeAttribute("data-more");
      box.removeAttribute("tabindex");
    }
  }

  function markScrollers() {
    Array.prototype.forEach.call(document.querySelectorAll(".scroll"), markScroller);
  }

  function startScrollers() {
    markScrollers();
    window.addEventListener("resize", markScrollers);
    window.addEventListener("load", markScrollers); // fonts and images change widths
    // Scroll events do not bubble: caught on their way down instead.
    document.addEventListener("scroll", function (event) {
      var box = event.target;
      if (box.classList && box.classList.contains("scroll")) {
        markScroller(box);
      }
    }, true);
  }

  // -- confirmations --------------------------------------------------------------------
  function bindConfirms(root) {
    var forms = root.querySelectorAll("form[data-confirm]");
    Array.prototype.forEach.call(forms, function (form) {
      var field = form.querySelector(".confirm-field");
      var input = form.querySelector("input[name=confirm]");
      if (!field || !input || form.hasAttribute("data-confirm-bound")) {
        return;
      }
      form.setAttribute("data-confirm-bound", "");
      // With the script, a dialog naming the node (the model, the key) replaces typing
      // its id: data-confirm-value, else data-node.
      field.classList.add("js-hidden");
      input.required = false;
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.getAttribute("data-confirm"))) {
          event.preventDefault();
          return;
        }
        input.value =
          form.getAttribute("data-confirm-value") || form.getAttribute("data-node");
      });
    });
  }

  // -- copy buttons ---------------------------------------------------------------------
  // A button with data-copy="ID" copies the text of the read-only field ID; shown only
  // where the Clipboard API is (a page over plain HTTP from another host has none: the
  // operator selects the text, which the field's focus does for them).
  function startCopies() {
    var buttons = document.querySelectorAll("button[data-copy]");
    Array.prototype.forEach.call(buttons, function (button) {
      var field = document.getElementById(button.getAttribute("data-copy"));
      var status = document.getElementById(button.id.replace(/-copy$/, "-copied"));
      if (!field) {
        return;
      }
      field.addEventListener("focus", function () {
        field.select();
      });
      if (!navigator.clipboard || !window.isSecureContext) {
        return;
      }
      button.hidden = false;
      button.addEventListener("click", function () {
        navigator.clipboard.writeText(field.value).then(
          function () {
            button.textContent = "Copied";
            button.classList.add("is-copied");
            if (status) {
              status.textContent = "copied to the clipboard";
            }
          },
          function () {
            field.focus();
            if (status) {
              status.textContent = "the browser refused; the text is selected: press Ctrl+C";
            }
          }
        );
      });
    });
  }

  // -- dependent choices ---------------------------------------------------------------
  // <select data-options-of="#other-select">: only the <optgroup> labelled with the other
  // select's value is offered (a model's own profiles); without the script, all are, and
  // the server refuses a profile the model lacks.
  function startDependentChoices() {
    var selects = document.querySelectorAll("select[data-options-of]");
    Array.prototype.forEach.call(selects, function (select) {
      var source = document.querySelector(select.getAttribute("data-options-of"));
      if (!source) {
        return;
      }
      var sync = function () {
        var firstShown = null;
        var chosenShown = false;
        Array.prototype.forEach.call(select.querySelectorAll("optgroup"), function (group) {
          var shown = group.label === source.value;
          group.hidden = !shown;
          group.disabled = !shown;
          if (shown && group.querySelector("option")) {
            firstShown = firstShown || group.querySelector("option");
            chosenShown = chosenShown || group.contains(select.selectedOptions[0] || null);
          }
        });
        if (!chosenShown && firstShown) {
          firstShown.selected = true;
        }
      };
      source.addEventListener("change", sync);
      sync();
    });
  }

  // -- live events ----------------------------------------------------------------------
  function eventRow(data) {
    var row = document.createElement("tr");
    row.setAttribute("data-event-id", String(data.id));
    row.className = "new";
    var time = document.createElement("time");
    time.setAttribute("datetime", data.time + "Z");
    time.textContent = data.time;
    var cells = [time, data.kind, data.subject, data.actor, data.message];
    cells.forEach(function (value, index) {
      var cell = document.createElement("td");
      if (index === 0) {
        cell.className = "when";
      }
      if (typeof value === "string") {
        cell.textContent = value; // text, never HTML
      } else {
        cell.appendChild(value);
      }
      row.appendChild(cell);
    });
    return row;
  }

  function say(text) {
    var status = document.getElementById("live-status");
    if (status) {
      status.textContent = text;
    }
  }

  function startStream() {
    var body = document.querySelector("tbody[data-stream]");
    if (!body || !window.EventSource) {
      return;
    }
    var source = new EventSource(body.getAttribute("data-stream"));
    source.onmessage = function (message) {
      var data;
      try {
        data = JSON.parse(message.data);
      } catch (e) {
        return;
      }
      var empty = body.querySelector("tr.empty");
      if (empty) {
        empty.remove();
      }
      body.insertBefore(eventRow(data), body.firstChild);
      while (body.rows.length > MAX_ROWS) {
        body.deleteRow(body.rows.length - 1);
      }
      markScrollers();
    };
    source.addEventListener("session-ended", function () {
      source.close();
      say("Your session ended; reload the page to sign in again.");
    });
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) {
        say("Live updates stopped; reload the page.");
      }
    };
  }

  document.addEventListener("DOMContentLoaded", function () {
    bindConfirms(document);
    startScrollers();
    startCopies();
    startDependentChoices();
    startLive();
    startStream();
  });
})();
