package pgoutboxui

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// point is one value of a chart at a time (unix milliseconds).
type point struct {
	at int64
	v  float64
}

// chart is an SVG line chart, drawn on the server: it needs no script and
// nothing vendored. Every field is a number or a label the template
// escapes.
type chart struct {
	Title  string
	Unit   string
	W, H   int
	Line   string // polyline points
	Area   string // polygon points (the line closed to the baseline)
	YMax   string
	YMid   string
	From   string
	To     string
	Last   string
	Empty  bool
	Note   string
	PlotX  int
	PlotY  int
	PlotW  int
	PlotH  int
	Bottom int
	Mid    int
}

const (
	chartW, chartH    = 280, 140
	padLeft, padRight = 48, 8
	padTop, padBottom = 8, 22
	sparkW, sparkH    = 120, 28
	sparkPad          = 2
)

// newChart draws pts (time order) with a y axis from 0.
func newChart(title, unit string, pts []point, format func(float64) string) chart {
	c := chart{Title: title, Unit: unit, W: chartW, H: chartH, PlotX: padLeft, PlotY: padTop,
		PlotW: chartW - padLeft - padRight, PlotH: chartH - padTop - padBottom}
	c.Bottom = c.PlotY + c.PlotH
	c.Mid = c.PlotY + c.PlotH/2
	if len(pts) < 2 {
		c.Empty = true
		c.Note = "collecting samples…"
		return c
	}
	pts = thin(pts, c.PlotW) // a point per pixel is as much as shows
	t0, t1 := pts[0].at, pts[len(pts)-1].at
	ymax := 0.0
	for _, p := range pts {
		ymax = math.Max(ymax, p.v)
	}
	ymax = niceCeil(ymax)
	c.Line, c.Area = polyline(pts, t0, t1, ymax, float64(c.PlotX), float64(c.PlotY), float64(c.PlotW), float64(c.PlotH))
	c.YMax, c.YMid = format(ymax), format(ymax/2)
	c.From = time.UnixMilli(t0).UTC().Format("15:04:05")
	c.To = time.UnixMilli(t1).UTC().Format("15:04:05 UTC")
	c.Last = format(pts[len(pts)-1].v)
	return c
}

// spark is a small chart without axes, for a table cell.
type spark struct {
	W, H int
	Line string
}

func newSpark(pts []point) spark {
	s := spark{W: sparkW, H: sparkH}
	if len(pts) < 2 {
		return s
	}
	pts = thin(pts, sparkW)
	ymax := 0.0
	for _, p := range pts {
		ymax = math.Max(ymax, p.v)
	}
	if ymax == 0 {
		ymax = 1
	}
	s.Line, _ = polyline(pts, pts[0].at, pts[len(pts)-1].at, ymax, sparkPad, sparkPad, sparkW-2*sparkPad, sparkH-2*sparkPad)
	return s
}

func polyline(pts []point, t0, t1 int64, ymax, x0, y0, w, h float64) (line, area string) {
	if ymax <= 0 {
		ymax = 1
	}
	span := float64(t1 - t0)
	if span <= 0 {
		span = 1
	}
	var b strings.Builder
	for i, p := range pts {
		if i > 0 {
			b.WriteByte(' ')
		}
		x := x0 + w*float64(p.at-t0)/span
		y := y0 + h - h*math.Min(p.v, ymax)/ymax
		b.WriteString(strconv.FormatFloat(x, 'f', 1, 64))
		b.WriteByte(',')
		b.WriteString(strconv.FormatFloat(y, 'f', 1, 64))
	}
	line = b.String()
	base := strconv.FormatFloat(y0+h, 'f', 1, 64)
	area = strconv.FormatFloat(x0, 'f', 1, 64) + "," + base + " " + line + " " + strconv.FormatFloat(x0+w, 'f', 1, 64) + "," + base
	return line, area
}

// thin keeps at most n points, taking the maximum of each bucket so a
// spike stays visible.
func thin(pts []point, n int) []point {
	if len(pts) <= n {
		return pts
	}
	out := make([]point, 0, n)
	step := float64(len(pts)) / float64(n)
	for i := range n {
		lo, hi := int(float64(i)*step), int(float64(i+1)*step)
		if hi > len(pts) {
			hi = len(pts)
		}
		best := pts[lo]
		for _, p := range pts[lo:hi] {
			if p.v > best.v {
				best.v = p.v
			}
		}
		best.at = pts[hi-1].at
		out = append(out, best)
	}
	return out
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

// count formats a count for an axis: 1.2k, 3M.
func count(v float64) string {
	switch {
	case v >= 1e6:
		return trim(v/1e6) + "M"
	case v >= 1e3:
		return trim(v/1e3) + "k"
	}
	return trim(v)
}

func trim(v float64) string {
	s := strconv.FormatFloat(v, 'f', 1, 64)
	return strings.TrimSuffix(s, ".0")
}

// perSec formats a rate.
func perSec(v float64) string { return count(v) + "/s" }

// seconds formats a duration given in seconds.
func seconds(v float64) string { return ageString(time.Duration(v * float64(time.Second))) }

// ageString formats an age for people: "-" for none.
func ageString(d time.Duration) string {
	switch {
	case d <= 0:
		return "-"
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		return trim(d.Seconds()) + "s"
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}
