// Package logbudget spreads out the error lines of one kind, so that a
// failure that comes back again and again (a connection killed each time
// it is made) writes a few lines a window, not one per occurrence.
package logbudget

import "time"

// PerWindow lines of a Budget are logged in each Window.
const (
	PerWindow = 5
	Window    = 30 * time.Second
)

// Budget counts the lines of one kind logged in the current window. Its
// zero value is ready; it is not safe for concurrent use: one owner.
type Budget struct {
	window time.Time
	spent  int
}

// Take reports whether a line may be logged now, and counts it.
func (b *Budget) Take(now time.Time) bool {
	if now.Sub(b.window) >= Window {
		b.window, b.spent = now, 0
	}
	if b.spent >= PerWindow {
		return false
	}
	b.spent++
	return true
}
