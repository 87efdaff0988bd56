package pgoutbox

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestExponentialBackoffDefaults(t *testing.T) {
	t.Parallel()
	p := ExponentialBackoff{Jitter: -1}
	want := []time.Duration{1, 2, 4, 8, 16, 32, 64, 128, 256}
	for i, w := range want {
		d, retry := p.NextDelay(i+1, nil)
		require.True(t, retry, "delivery %d", i+1)
		require.Equal(t, w*time.Second, d, "delivery %d", i+1)
	}
	_, retry := p.NextDelay(10, nil)
	require.False(t, retry, "the default gives up after 10 deliveries")
}

func TestExponentialBackoffCapsAtMaxInterval(t *testing.T) {
	t.Parallel()
	p := ExponentialBackoff{InitialInterval: time.Second, Multiplier: 3, MaxInterval: 10 * time.Second, MaxAttempts: -1, Jitter: -1}
	d, retry := p.NextDelay(5, nil)
	require.True(t, retry)
	require.Equal(t, 10*time.Second, d)
	// Unlimited attempts and a huge delivery count stay capped and cheap.
	d, retry = p.NextDelay(1_000_000, nil)
	require.True(t, retry)
	require.Equal(t, 10*time.Second, d)
}

func TestExponentialBackoffJitterStaysInBounds(t *testing.T) {
	t.Parallel()
	p := ExponentialBackoff{InitialInterval: 100 * time.Millisecond, Jitter: 0.2}
	seen := map[time.Duration]bool{}
	for range 1000 {
		d, retry := p.NextDelay(3, nil) // 400ms before jitter
		require.True(t, retry)
		require.GreaterOrEqual(t, d, 320*time.Millisecond)
		require.LessOrEqual(t, d, 480*time.Millisecond)
		seen[d] = true
	}
	require.Greater(t, len(seen), 100, "jitter must actually spread the delays")
}

func TestConstantBackoff(t *testing.T) {
	t.Parallel()
	p := ConstantBackoff{Delay: 300 * time.Millisecond, MaxAttempts: 3}
	for n := 1; n <= 2; n++ {
		d, retry := p.NextDelay(n, nil)
		require.True(t, retry)
		require.Equal(t, 300*time.Millisecond, d)
	}
	_, retry := p.NextDelay(3, nil)
	require.False(t, retry)

	_, retry = ConstantBackoff{}.NextDelay(10, nil)
	require.False(t, retry, "MaxAttempts defaults to 10")
	_, retry = ConstantBackoff{MaxAttempts: -1}.NextDelay(1_000, nil)
	require.True(t, retry, "-1 retries forever")
}

func TestNoRetry(t *testing.T) {
	t.Parallel()
	_, retry := NoRetry().NextDelay(1, errors.New("x"))
	require.False(t, retry)
}

func TestRetryPolicyFuncRetriesOnlyTransientErrors(t *testing.T) {
	t.Parallel()
	errPermanent := errors.New("invalid order")
	p := RetryPolicyFunc(func(n int, err error) (time.Duration, bool) {
		if errors.Is(err, errPermanent) {
			return 0, false
		}
		return ConstantBackoff{Delay: time.Second}.NextDelay(n, err)
	})
	_, retry := p.NextDelay(1, errPermanent)
	require.False(t, retry)
	d, retry := p.NextDelay(1, errors.New("connection reset"))
	require.True(t, retry)
	require.Equal(t, time.Second, d)
}

func TestBoundError(t *testing.T) {
	t.Parallel()
	require.Equal(t, "short", boundError("short"))
	long := strings.Repeat("é", maxErrorLen) // 2 bytes per rune
	got := boundError(long)
	require.LessOrEqual(t, len(got), maxErrorLen)
	require.True(t, strings.HasSuffix(got, truncatedMarker))
	require.True(t, strings.HasPrefix(got, "éé"))
	require.True(t, utf8.ValidString(got), "the cut must fall on a rune boundary")
}

// An interval near the largest Duration (a "no cap" of math.MaxInt64)
// overflowed with its jitter into a negative delay: a redelivery at once.
func TestExponentialBackoffWithoutACapStaysPositive(t *testing.T) {
	t.Parallel()
	for _, b := range []ExponentialBackoff{
		{InitialInterval: time.Second, MaxInterval: math.MaxInt64, MaxAttempts: RetryForever},
		{InitialInterval: math.MaxInt64, MaxInterval: math.MaxInt64, MaxAttempts: RetryForever},
		{InitialInterval: 10 * time.Millisecond, Multiplier: 1e12, MaxInterval: math.MaxInt64, MaxAttempts: RetryForever, Jitter: 1},
	} {
		for _, n := range []int{1, 2, 3, 70, 1000} {
			for range 20 {
				d, retry := b.NextDelay(n, nil)
				require.True(t, retry)
				require.Positive(t, d, "%+v after %d deliveries", b, n)
			}
		}
	}
}
