// Command accuracyplot draws docs/accuracy.svg from the per-second allowed
// counts that BenchmarkAccuracyTable writes:
//
//	go test -run BenchmarkAccuracyTable -accuracy docs/accuracy.tsv .
//	go run ./internal/accuracyplot -in docs/accuracy.tsv -out docs/accuracy.svg
//
// One panel for even load and one for 80/15/5 load; Redis is paused from
// second 2 to second 5. It uses the standard library only, so that no
// plotting dependency enters the module.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"html"
	"log"
	"os"
	"strconv"
	"strings"
)

type series struct {
	label string
	vals  []float64
}

func main() {
	in := flag.String("in", "docs/accuracy.tsv", "per-second counts from BenchmarkAccuracyTable")
	out := flag.String("out", "docs/accuracy.svg", "the SVG to write")
	flag.Parse()
	all, err := read(*in)
	if err != nil {
		log.Fatal(err)
	}
	var even, uneven []series
	for _, s := range all {
		if strings.Contains(s.label, "[80 15 5]") {
			s.label = strings.Replace(s.label, " [80 15 5]", "", 1)
			uneven = append(uneven, s)
		} else {
			even = append(even, s)
		}
	}
	var b strings.Builder
	const w, h = 1000, 460
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", w, h)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", w, h)
	panel(&b, 0, "even load (3 × 66.7/s offered)", even)
	panel(&b, w/2, "uneven load (80/15/5 of 200/s)", uneven)
	b.WriteString("</svg>\n")
	if err := os.WriteFile(*out, []byte(b.String()), 0o644); err != nil {
		log.Fatal(err)
	}
}

func read(path string) ([]series, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var all []series
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		label, nums, ok := strings.Cut(sc.Text(), "\t")
		if !ok {
			continue
		}
		s := series{label: label}
		for _, f := range strings.Fields(nums) {
			v, err := strconv.ParseFloat(f, 64)
			if err != nil {
				return nil, fmt.Errorf("%s: %q: %v", path, label, err)
			}
			s.vals = append(s.vals, v)
		}
		all = append(all, s)
	}
	return all, sc.Err()
}

// names gives the variants of BenchmarkAccuracyTable the names of docs/accuracy.md
// and one colour each, the same in both panels.
var names = []struct{ label, name, color string }{
	{"FailLocal", "hybridlimit (FailLocal)", "#d62728"},
	{"FailLocal, no hand-off, no reconciliation, no fleet shares", "plain local fallback", "#7f7f7f"},
	{"FailOpen", "FailOpen", "#ff7f0e"},
	{"FailClosed", "FailClosed", "#1f77b4"},
	{"FailLocal, no hand-off", "hybridlimit without hand-off", "#9467bd"},
	{"FailLocal, no reconciliation", "hybridlimit without reconciliation", "#8c564b"},
	{"FailLocal, no fleet shares", "hybridlimit without fleet shares", "#2ca02c"},
}

func style(label string) (name, color string) {
	for _, n := range names {
		if n.label == label {
			return n.name, n.color
		}
	}
	return label, "#e377c2"
}

// panel draws one chart at x offset ox: allowed per second against time,
// with the outage shaded and the limit drawn.
func panel(b *strings.Builder, ox int, title string, ss []series) {
	const left, top, pw, ph, ymax = 50, 40, 400, 260, 220.0
	x := func(sec float64) float64 { return float64(ox+left) + sec/8*pw }
	y := func(v float64) float64 { return top + ph - v/ymax*ph }
	fmt.Fprintf(b, `<text x="%d" y="20" font-size="14" font-weight="bold">%s</text>`+"\n", ox+left, html.EscapeString(title))
	fmt.Fprintf(b, `<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="#eeeeee"/>`+"\n", x(2), top, x(5)-x(2), ph)
	fmt.Fprintf(b, `<text x="%.1f" y="%d" fill="#666">Redis paused</text>`+"\n", x(2)+4, top+14)
	for v := 0.0; v <= 200; v += 50 {
		fmt.Fprintf(b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", x(0), x(8), y(v), y(v))
		fmt.Fprintf(b, `<text x="%.1f" y="%.1f" text-anchor="end">%.0f</text>`+"\n", x(0)-4, y(v)+4, v)
	}
	fmt.Fprintf(b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="black" stroke-dasharray="4 3"/>`+"\n", x(0), x(8), y(100), y(100))
	for s := 0; s <= 8; s++ {
		fmt.Fprintf(b, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", x(float64(s)), top+ph+16, s)
	}
	fmt.Fprintf(b, `<text x="%.1f" y="%d" text-anchor="middle">second (counts at the middle of each)</text>`+"\n", x(4), top+ph+32)
	fmt.Fprintf(b, `<text x="%d" y="%d" transform="rotate(-90 %d %d)" text-anchor="middle">allowed per second (limit 100)</text>`+"\n",
		ox+14, top+ph/2, ox+14, top+ph/2)
	for i, s := range ss {
		name, c := style(s.label)
		var pts []string
		for sec, v := range s.vals {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(float64(sec)+0.5), y(min(v, ymax))))
		}
		width := 1.5
		if i == 0 {
			width = 3
		}
		fmt.Fprintf(b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="%.1f"/>`+"\n", strings.Join(pts, " "), c, width)
		ly := top + ph + 48 + i*14
		fmt.Fprintf(b, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="%.1f"/>`+"\n", ox+left, ox+left+20, ly-4, ly-4, c, width)
		fmt.Fprintf(b, `<text x="%d" y="%d">%s</text>`+"\n", ox+left+26, ly, html.EscapeString(name))
	}
}
