package logbudget

import (
	"testing"
	"time"
)

// PerWindow lines in each Window, whatever comes in between.
func TestBudgetTakesPerWindowLinesAWindow(t *testing.T) {
	var b Budget
	start := time.Now()
	taken := 0
	for i := range 300 { // one a 200 ms, a minute
		if b.Take(start.Add(time.Duration(i) * 200 * time.Millisecond)) {
			taken++
		}
	}
	if want := 2 * PerWindow; taken != want {
		t.Fatalf("took %d lines in two windows, want %d", taken, want)
	}
}
