package pgoutboxotel_test

import (
	"testing"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestMain drops the reused test schemas and fails the run if one was left.
func TestMain(m *testing.M) { pgoutboxtest.Main(m) }
