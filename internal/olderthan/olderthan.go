// Package olderthan parses the ages operators type: a Go duration, or whole
// days ("30d"), which Go durations lack.
package olderthan

import (
	"math"
	"strconv"
	"strings"
	"time"
)

// maxDays is the most days a time.Duration holds (about 106,751).
const maxDays = int(math.MaxInt64 / int64(24*time.Hour))

// Parse reads "30d", "12h", "90m" or any Go duration; ok is false for
// anything else, for a negative age and for one past what a Duration
// holds.
func Parse(s string) (d time.Duration, ok bool) {
	s = strings.TrimSpace(s)
	if n, found := strings.CutSuffix(s, "d"); found {
		// Past maxDays the product wraps around to a short or negative
		// age: "keep everything" would purge recent dead letters.
		if days, err := strconv.Atoi(n); err == nil && days >= 0 && days <= maxDays {
			return time.Duration(days) * 24 * time.Hour, true
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, false
	}
	return d, true
}
