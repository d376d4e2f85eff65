// The resilience report: draws each server-built plotly figure ([data-figure] names its JSON block).
// Loaded by the page and inlined into the self-contained HTML file, so it fetches nothing.
(function () {
  "use strict";
  const CONFIG = {
    responsive: true, displaylogo: false, showSendToCloud: false, showEditInChartStudio: false,
    showLink: false,
    plotlyServerURL: "", linkText: "", modeBarButtonsToRemove: ["sendDataToCloud", "editInChartStudio"],
  };
  function drawAll() {
    if (typeof Plotly === "undefined") return;
    document.querySelectorAll("[data-figure]").forEach(function (div) {
      const el = document.getElementById(div.dataset.figure);
      if (!el) return;
      const fig = JSON.parse(el.textContent);
      Plotly.newPlot(div, fig.data, fig.layout, CONFIG).then(function () { div.dataset.drawn = "1"; });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", drawAll);
  else drawAll();
})();
