// km0 console: select-all checkboxes, and live progress of a replay job.
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
          var p = document.getElementById("job-progress");
          p.max = s.total; p.value = s.republicades;
          document.getElementById("job-pct").textContent = (s.total ? Math.floor(s.republicades * 100 / s.total) : 100) + "%";
          if (s.estat !== "running") { location.reload(); } else { setTimeout(poll, 500); }
        })
        .catch(function () { setTimeout(poll, 2000); });
    };
    setTimeout(poll, 300);
  }
});
