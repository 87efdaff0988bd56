// Package olderthan parses the ages operators type: a Go duration, or whole
// days ("30d"), which Go durations lack.
package olderthan

import (
	"strconv"
	"strings"
	"time"
)

// Parse reads "30d", "12h", "90m" or any Go duration; ok is false for
// anything else and for a negative age.
func Parse(s string) (d time.Duration, ok bool) {
	s = strings.TrimSpace(s)
	if n, found := strings.CutSuffix(s, "d"); found {
		if days, err := strconv.Atoi(n); err == nil && days >= 0 {
			return time.Duration(days) * 24 * time.Hour, true
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, false
	}
	return d, true
}
