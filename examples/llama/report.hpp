// examples/llama/report.hpp — the run's record: one row per optimizer step, written as CSV and as an SVG
// plot of the loss and the tracked memory over the steps (two panels, stages side by side).
#pragma once

#include <memkit/config.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace example {

struct step_record {
  int stage = 1;
  std::int64_t step = 0;        // within the stage
  double loss = 0;              // mean training loss of the step's micro-batches
  double tokens_per_second = 0;
  std::uint64_t current_bytes = 0;  // tracked after the step
  std::uint64_t peak_bytes = 0;     // tracked peak of the stage so far
  double lr = 0;
};

inline void write_csv(const std::string& path, const std::vector<step_record>& rows) {
  std::ofstream out(path);
  memkit::require(out.good(), "write_csv: cannot write '" + path + "'");
  out << "stage,step,loss,tokens_per_second,current_bytes,peak_bytes,lr\n";
  char line[256];
  for (const step_record& r : rows) {
    std::snprintf(line, sizeof line, "%d,%lld,%.6f,%.1f,%llu,%llu,%.6g\n", r.stage, static_cast<long long>(r.step), r.loss,
                  r.tokens_per_second, static_cast<unsigned long long>(r.current_bytes),
                  static_cast<unsigned long long>(r.peak_bytes), r.lr);
    out << line;
  }
  memkit::require(out.good(), "write_csv: writing '" + path + "' failed");
}

// Loss (top) and memory in MiB (bottom) against the global step; a dashed line where stage 2 starts.
inline void write_svg(const std::string& path, const std::vector<step_record>& rows, const std::string& title) {
  memkit::require(!rows.empty(), "write_svg: no steps to plot");
  const double width = 760, panel = 220, left = 70, right = 20, top = 40, gap = 60;
  const double plot_w = width - left - right;
  const double n = static_cast<double>(rows.size());
  double max_loss = 0, max_mib = 0;
  std::size_t stage2 = rows.size();
  for (std::size_t i = 0; i < rows.size(); ++i) {
    max_loss = std::max(max_loss, rows[i].loss);
    max_mib = std::max(max_mib, static_cast<double>(rows[i].peak_bytes) / (1024.0 * 1024.0));
    if (rows[i].stage == 2 && stage2 == rows.size()) stage2 = i;
  }
  max_loss = max_loss > 0 ? max_loss * 1.05 : 1;
  max_mib = max_mib > 0 ? max_mib * 1.1 : 1;
  auto x_of = [&](std::size_t i) { return left + plot_w * (n > 1 ? static_cast<double>(i) / (n - 1) : 0.5); };
  char buf[256];
  std::string svg;
  const double height = top + 2 * panel + gap + 40;
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
                "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                width, height);
  svg += buf;
  std::string escaped;
  for (char c : title) escaped += c == '<' ? std::string("&lt;") : c == '>' ? std::string("&gt;") : c == '&' ? std::string("&amp;") : std::string(1, c);
  svg += "<text x=\"" + std::to_string(static_cast<int>(left)) + "\" y=\"22\" font-size=\"14\">" + escaped + "</text>\n";
  auto panel_frame = [&](double y0, const char* label, double max_value, const char* unit) {
    std::snprintf(buf, sizeof buf, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#888\"/>\n",
                  left, y0, plot_w, panel);
    svg += buf;
    for (int t = 0; t <= 4; ++t) {
      const double y = y0 + panel - panel * t / 4.0;
      std::snprintf(buf, sizeof buf, "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.2f%s</text>\n", left - 6, y + 4,
                    max_value * t / 4.0, unit);
      svg += buf;
    }
    std::snprintf(buf, sizeof buf, "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n", left + 6, y0 + 16, label);
    svg += buf;
    if (stage2 < rows.size()) {
      std::snprintf(buf, sizeof buf,
                    "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#999\" stroke-dasharray=\"4 3\"/>\n"
                    "<text x=\"%.1f\" y=\"%.0f\" fill=\"#666\">stage 2 (QLoRA)</text>\n",
                    x_of(stage2), y0, x_of(stage2), y0 + panel, x_of(stage2) + 4, y0 + panel - 6);
      svg += buf;
    }
  };
  auto polyline = [&](double y0, double max_value, const char* color, auto value_of) {
    svg += "<polyline fill=\"none\" stroke=\"";
    svg += color;
    svg += "\" stroke-width=\"1.5\" points=\"";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x_of(i), y0 + panel - panel * value_of(rows[i]) / max_value);
      svg += buf;
    }
    svg += "\"/>\n";
  };
  const double y_loss = top, y_mem = top + panel + gap;
  panel_frame(y_loss, "training loss (nats per byte)", max_loss, "");
  polyline(y_loss, max_loss, "#1f77b4", [](const step_record& r) { return r.loss; });
  panel_frame(y_mem, "tracked memory: peak (red), after the step (green)", max_mib, " MiB");
  polyline(y_mem, max_mib, "#d62728", [](const step_record& r) { return static_cast<double>(r.peak_bytes) / 1048576.0; });
  polyline(y_mem, max_mib, "#2ca02c", [](const step_record& r) { return static_cast<double>(r.current_bytes) / 1048576.0; });
  std::snprintf(buf, sizeof buf, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">optimizer step (%zu in all)</text>\n",
                left + plot_w / 2, height - 10, rows.size());
  svg += buf;
  svg += "</svg>\n";
  std::ofstream out(path);
  memkit::require(out.good(), "write_svg: cannot write '" + path + "'");
  out << svg;
  memkit::require(out.good(), "write_svg: writing '" + path + "' failed");
}

}  // namespace example
