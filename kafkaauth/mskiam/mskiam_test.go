package mskiam_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/url"
	"sort"
	"strings"
	"testing"
	"time"

	signer "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/segmentio/kafka-go/sasl"
	msk "github.com/segmentio/kafka-go/sasl/aws_msk_iam_v2"

	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/kafkaauth/mskiam"
	"github.com/kfn-dev/kfn/runtime"
)

// emptyHash is the hex SHA-256 of no bytes: the payload hash of a request
// without a body.
const emptyHash = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

// The AWS documentation's example credentials.
const (
	exampleKeyID  = "AKIDEXAMPLE"
	exampleSecret = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
)

func hmacSHA256(key []byte, data string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(data))
	return m.Sum(nil)
}

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// signingKey derives the Signature Version 4 signing key: HMAC-SHA256
// chained over the date, the region, the service and "aws4_request",
// starting from "AWS4" and the secret.
func signingKey(secret, date, region, service string) []byte {
	k := hmacSHA256([]byte("AWS4"+secret), date)
	k = hmacSHA256(k, region)
	k = hmacSHA256(k, service)
	return hmacSHA256(k, "aws4_request")
}

// signature signs a canonical request as Signature Version 4 describes:
// the string to sign is the algorithm, the time, the credential scope and
// the hex SHA-256 of the canonical request, one per line.
func signature(secret, amzDate, region, service, canonicalRequest string) string {
	date := amzDate[:8]
	scope := date + "/" + region + "/" + service + "/aws4_request"
	toSign := "AWS4-HMAC-SHA256\n" + amzDate + "\n" + scope + "\n" + sha256Hex(canonicalRequest)
	return hex.EncodeToString(hmacSHA256(signingKey(secret, date, region, service), toSign))
}

// uriEncode encodes s as Signature Version 4 wants: every byte but the
// unreserved characters A-Z a-z 0-9 - _ . ~ as %XY.
func uriEncode(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' || strings.IndexByte("-_.~", c) >= 0 {
			b.WriteByte(c)
		} else {
			b.WriteString("%" + strings.ToUpper(hex.EncodeToString([]byte{c})))
		}
	}
	return b.String()
}

// canonicalQuery is the query's parameters, encoded and sorted by name.
func canonicalQuery(params map[string]string) string {
	var parts []string
	for k, v := range params {
		parts = append(parts, uriEncode(k)+"="+uriEncode(v))
	}
	sort.Strings(parts)
	return strings.Join(parts, "&")
}

// TestTheTestsSignerSignsTheAWSDocumentationsExamples checks this file's
// own Signature Version 4 code against the examples of the AWS
// documentation: the derived signing key of "Examples of how to derive a
// signing key" and the signed GET of IAM's ListUsers of "Create a signed
// AWS API request".
func TestTheTestsSignerSignsTheAWSDocumentationsExamples(t *testing.T) {
	if got, want := hex.EncodeToString(signingKey(exampleSecret, "20120215", "us-east-1", "iam")), "f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d"; got != want {
		t.Errorf("signing key %s, want %s", got, want)
	}
	canonical := "GET\n/\nAction=ListUsers&Version=2010-05-08\n" +
		"content-type:application/x-www-form-urlencoded; charset=utf-8\nhost:iam.amazonaws.com\nx-amz-date:20150830T123600Z\n\n" +
		"content-type;host;x-amz-date\n" + emptyHash
	if got, want := sha256Hex(canonical), "f536975d06c0309214f805bb90ccff089219ecd68b2577efef23edd43b7e1a59"; got != want {
		t.Errorf("hash of the canonical request %s, want %s", got, want)
	}
	if got, want := signature(exampleSecret, "20150830T123600Z", "us-east-1", "iam", canonical), "5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7"; got != want {
		t.Errorf("signature %s, want %s", got, want)
	}
}

// TestAWSMSKIAMSignsAsAWSDescribes signs a login with fixed credentials at
// a fixed time and checks the payload field by field against the
// aws-msk-iam-auth protocol (version 2020_10_22: the action
// kafka-cluster:Connect on the broker's host, presigned with Signature
// Version 4 for the service kafka-cluster, the host the only signed
// header), and the signature both against one computed here from the AWS
// documentation's steps and against the recorded one.
func TestAWSMSKIAMSignsAsAWSDescribes(t *testing.T) {
	const (
		host    = "b-1.kfn-example.abc123.c3.kafka.eu-west-1.amazonaws.com"
		region  = "eu-west-1"
		token   = "IQoJb3JpZ2luX2VjEXAMPLE/session+token="
		amzDate = "20240102T030405Z"
		// recorded is the signature of this login, recorded when the test
		// was written: a change of the signing shows here first.
		recorded = "35003bca057a7b7dd6cca8d4d623cb98712b6a4db56d26824a718eaf2356d6e5"
	)
	m := &msk.Mechanism{
		Signer:      signer.NewSigner(),
		Credentials: credentials.NewStaticCredentialsProvider(exampleKeyID, exampleSecret, token),
		Region:      region,
		SignTime:    time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC),
	}
	ctx := sasl.WithMetadata(context.Background(), &sasl.Metadata{Host: host, Port: 9098})
	_, ir, err := m.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var payload map[string]string
	if err := json.Unmarshal(ir, &payload); err != nil {
		t.Fatalf("the login is not a JSON object of strings: %v\n%s", err, ir)
	}
	t.Logf("payload: %s", ir)
	want := map[string]string{
		"version":              "2020_10_22",
		"host":                 host,
		"action":               "kafka-cluster:Connect",
		"x-amz-algorithm":      "AWS4-HMAC-SHA256",
		"x-amz-credential":     exampleKeyID + "/20240102/" + region + "/kafka-cluster/aws4_request",
		"x-amz-date":           amzDate,
		"x-amz-expires":        "300",
		"x-amz-signedheaders":  "host",
		"x-amz-security-token": token,
	}
	for k, v := range want {
		if payload[k] != v {
			t.Errorf("%s = %q, want %q", k, payload[k], v)
		}
	}
	if !strings.HasPrefix(payload["user-agent"], "kafka-go/sasl/aws_msk_iam_v2/") {
		t.Errorf("user-agent = %q", payload["user-agent"])
	}
	query := canonicalQuery(map[string]string{
		"Action":               "kafka-cluster:Connect",
		"X-Amz-Algorithm":      "AWS4-HMAC-SHA256",
		"X-Amz-Credential":     want["x-amz-credential"],
		"X-Amz-Date":           amzDate,
		"X-Amz-Expires":        "300",
		"X-Amz-Security-Token": token,
		"X-Amz-SignedHeaders":  "host",
	})
	canonical := "GET\n/\n" + query + "\nhost:" + host + "\n\nhost\n" + emptyHash
	if got, computed := payload["x-amz-signature"], signature(exampleSecret, amzDate, region, "kafka-cluster", canonical); got != computed {
		t.Errorf("x-amz-signature = %s, but the canonical request\n%s\nsigns to %s", got, canonical, computed)
	}
	if got := payload["x-amz-signature"]; got != recorded {
		t.Errorf("x-amz-signature = %s, want the recorded %s", got, recorded)
	}
	extra := map[string]bool{"user-agent": true, "x-amz-signature": true}
	for k := range payload {
		if _, ok := want[k]; !ok && !extra[k] {
			t.Errorf("unexpected field %s = %q", k, payload[k])
		}
	}
}

// TestImportingTheModuleLetsKfnConnectWithAWSMSKIAM checks the opt-in: with
// this package imported, --kafka-sasl-mechanism AWS_MSK_IAM builds kfn's
// connections with the mechanism, credentials and region from the AWS
// SDK's default chain (here the environment).
func TestImportingTheModuleLetsKfnConnectWithAWSMSKIAM(t *testing.T) {
	t.Setenv("AWS_ACCESS_KEY_ID", exampleKeyID)
	t.Setenv("AWS_SECRET_ACCESS_KEY", exampleSecret)
	t.Setenv("AWS_REGION", "eu-west-1")
	t.Setenv("AWS_CONFIG_FILE", t.TempDir()+"/none")
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", t.TempDir()+"/none")
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	transport, dialer, err := kafkaconn.Kafka(runtime.KafkaSecurity{TLS: true, SASLMechanism: mskiam.Name})
	if err != nil {
		t.Fatal(err)
	}
	if transport.SASL == nil || transport.SASL.Name() != mskiam.Name || dialer.SASLMechanism.Name() != mskiam.Name {
		t.Fatalf("the connections' SASL mechanism is %v, want %s", transport.SASL, mskiam.Name)
	}
	_, ir, err := transport.SASL.Start(sasl.WithMetadata(context.Background(), &sasl.Metadata{Host: "b-1.example", Port: 9098}))
	if err != nil {
		t.Fatal(err)
	}
	var payload map[string]string
	if err := json.Unmarshal(ir, &payload); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(payload["x-amz-credential"], exampleKeyID+"/") || !strings.Contains(payload["x-amz-credential"], "/eu-west-1/kafka-cluster/") {
		t.Errorf("x-amz-credential = %q: not the environment's key and region", payload["x-amz-credential"])
	}
	if _, err := url.Parse("kafka://" + payload["host"]); err != nil || payload["host"] != "b-1.example" {
		t.Errorf("host = %q, want the broker's", payload["host"])
	}
}
