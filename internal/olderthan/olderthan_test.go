package olderthan

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	for in, want := range map[string]time.Duration{"30d": 30 * 24 * time.Hour, " 12h ": 12 * time.Hour, "90m": 90 * time.Minute, "0": 0, "0d": 0} {
		d, ok := Parse(in)
		require.True(t, ok, in)
		require.Equal(t, want, d, in)
	}
	for _, in := range []string{"", "-1h", "-2d", "soon", "1.5d", "d"} {
		_, ok := Parse(in)
		require.False(t, ok, in)
	}
}

// A day count past what a time.Duration holds wrapped around: "213504d"
// (about 585 years: keep everything) came back as 25m26s, and a purge with
// it deleted dead letters half an hour old.
func TestDaysPastADurationAreRefused(t *testing.T) {
	for _, in := range []string{"106752d", "213504d", "100000000d", "99999999999d"} {
		d, ok := Parse(in)
		require.False(t, ok, "%s parsed as %v", in, d)
	}
	d, ok := Parse("106751d")
	require.True(t, ok)
	require.Positive(t, d)
}
