// km0 console: select-all checkboxes, live progress of a replay job, and
// pages that refresh themselves (body data-refresh, in seconds): the page is
// fetched again and each element of class "live" replaced by its new copy;
// #refreshed says when, or that the last refresh failed. A refresh waits
// while the operator types in, or has ticked a box of, a live part.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      document.querySelectorAll("input.pick").forEach(function (c) { c.checked = all.checked; });
    });
  }
  var job = document.getElementById("job");
  if (job && job.dataset.state === "running") {
    var poll = function () {
      fetch("/feina.json?id=" + encodeURIComponent(job.dataset.id), { credentials: "same-origin" })
        .then(function (r) { return r.json(); })
        .then(function (s) {
          document.getElementById("republished").textContent = s.republicades;
          document.getElementById("failed").textContent = s.fallides;
          document.getElementById("job-total").textContent = s.total;
          var left = document.getElementById("job-left");
          if (left) { left.textContent = s.pendents; }
          var p = document.getElementById("job-progress");
          p.max = s.total; p.value = s.republicades;
          document.getElementById("job-pct").textContent = (s.total ? Math.floor(s.republicades * 100 / s.total) : 100) + "%";
          if (s.estat !== "running") { location.reload(); } else { setTimeout(poll, 500); }
        })
        .catch(function () { setTimeout(poll, 2000); });
    };
    setTimeout(poll, 300);
  }
  var every = parseInt(document.body.dataset.refresh || "0", 10);
  var stamp = document.getElementById("refreshed");
  if (every > 0 && window.fetch && window.DOMParser) {
    var two = function (n) { return (n < 10 ? "0" : "") + n; };
    var hms = function (d) { return two(d.getUTCHours()) + ":" + two(d.getUTCMinutes()) + ":" + two(d.getUTCSeconds()); };
    var busy = function () {
      var a = document.activeElement;
      if (a && a.closest && a.closest(".live") && (a.tagName === "INPUT" || a.tagName === "SELECT" || a.tagName === "TEXTAREA")) { return true; }
      return document.querySelector(".live input[type=checkbox]:checked") !== null;
    };
    var refresh = function () {
      if (busy()) { setTimeout(refresh, every * 1000); return; }
      fetch(location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
        .then(function (html) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          document.querySelectorAll(".live[id]").forEach(function (el) {
            var fresh = doc.getElementById(el.id);
            if (fresh) { el.replaceWith(document.importNode(fresh, true)); }
          });
          if (stamp) {
            var at = new Date();
            stamp.textContent = "updated " + hms(at) + " UTC";
            stamp.dataset.at = at.toISOString();
            stamp.classList.remove("bad");
          }
        })
        .catch(function () {
          if (stamp) { stamp.textContent = "refresh failed at " + hms(new Date()) + " UTC; retrying"; stamp.classList.add("bad"); }
        })
        .then(function () { setTimeout(refresh, every * 1000); });
    };
    setTimeout(refresh, every * 1000);
  }
});
