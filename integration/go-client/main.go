// Command go-client walks an egressproxy Provider with Go code generated from the
// contract by the documented commands (docs/contract.md, "Code generation"):
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
//	buf generate --template buf.gen.go.yaml
//
// It is the third language beside Rust and Python that proves the contract can be used
// from the proto and the docs alone: health, plugin info, an idempotent Create, a
// conflict and an invalid request with their error details decoded, RUNNING with an
// address, a paged List (and a foreign page token refused), and Delete until NOT_FOUND.
// Everything it creates carries the tag egressproxy.dev/client=go and is deleted.
//
// Usage: go-client -endpoint 127.0.0.1:50051 -machine-type small -image debian-12
//
// It prints one line per step and exits 1 at the first answer the contract does not
// allow, saying what was expected and what came back.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "example.com/egressproxy/gen/go/egressproxy/provider/v1"
)

const (
	service = "egressproxy.provider.v1.Provider"
	domain  = "egressproxy.dev"
	tagKey  = "egressproxy.dev/client"
)

func main() {
	endpoint := flag.String("endpoint", "127.0.0.1:50051", "the provider's host:port (plaintext)")
	machineType := flag.String("machine-type", "small", "a machine type the provider offers")
	image := flag.String("image", "debian-12", "an image the provider offers")
	runningTimeout := flag.Duration("running-timeout", 60*time.Second, "how long an instance may take to run")
	flag.Parse()

	conn, err := grpc.NewClient(*endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fail("a client for %s", *endpoint, err)
	}
	defer conn.Close()
	w := walk{
		provider:  pb.NewProviderClient(conn),
		health:    healthpb.NewHealthClient(conn),
		placement: &pb.Placement{MachineType: *machineType, Image: *image},
		key:       fmt.Sprintf("go-%d-%d", os.Getpid(), time.Now().UnixNano()),
		running:   *runningTimeout,
	}
	w.run()
	fmt.Println("go-client: every step kept the contract")
}

type walk struct {
	provider  pb.ProviderClient
	health    healthpb.HealthClient
	placement *pb.Placement
	key       string
	running   time.Duration
}

func (w *walk) run() {
	for _, name := range []string{"", service} {
		answer, err := w.health.Check(ctx(), &healthpb.HealthCheckRequest{Service: name})
		if err != nil || answer.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			fail("health of %q SERVING", name, err)
		}
	}
	step("health: SERVING")

	info, err := w.provider.GetPluginInfo(ctx(), &pb.GetPluginInfoRequest{})
	if err != nil || !strings.HasPrefix(info.GetContractVersion(), "1.") {
		fail("GetPluginInfo with contract version 1.x, got %q", info.GetContractVersion(), err)
	}
	step("plugin %s %s, contract %s", info.GetName(), info.GetVendorVersion(), info.GetContractVersion())

	request := &pb.CreateInstanceRequest{
		Key:       w.key,
		Name:      "go-client/walk",
		Tags:      map[string]string{tagKey: "go"},
		Placement: w.placement,
		CloudInit: &pb.CloudInit{UserData: []byte("#cloud-config\n{}\n")},
		ProxyPort: 3128,
	}
	created := w.create(request)
	again := w.create(request)
	if again.GetId() != created.GetId() {
		fail("a repeated Create returns instance %s", created.GetId(), fmt.Errorf("got %s", again.GetId()))
	}
	step("create: %s, and again the same", created.GetId())

	conflicting := *request
	conflicting.ProxyPort = 3129
	_, err = w.provider.CreateInstance(ctx(), &conflicting)
	reason := expectCode(err, codes.AlreadyExists, "a Create of the key with another port")
	step("conflict: ALREADY_EXISTS (%s)", reason)

	invalid := *request
	invalid.Key = ""
	_, err = w.provider.CreateInstance(ctx(), &invalid)
	expectCode(err, codes.InvalidArgument, "a Create with an empty key")
	if !violates(err, "key") {
		fail("a BadRequest naming %s", "key", err)
	}
	step("invalid: INVALID_ARGUMENT naming key")

	instance := w.waitRunning(created.GetId())
	step("running at %s", instance.GetAddresses()[0].GetAddress())

	listed := w.list()
	found := false
	for _, id := range listed {
		found = found || id == created.GetId()
	}
	if !found {
		fail("the instance listed by its tag, in pages of %s", "1", fmt.Errorf("listed %v", listed))
	}
	step("list: %d instance(s) in pages of 1", len(listed))

	_, err = w.provider.ListInstances(ctx(), &pb.ListInstancesRequest{PageToken: "not-a-page-token"})
	expectCode(err, codes.InvalidArgument, "a List with a made-up page token")
	if !violates(err, "page_token") {
		fail("a BadRequest naming %s", "page_token", err)
	}
	step("list: a made-up page token is INVALID_ARGUMENT naming page_token")

	for range 2 {
		if _, err := w.provider.DeleteInstance(ctx(), &pb.DeleteInstanceRequest{Id: created.GetId()}); err != nil {
			fail("Delete of %s succeeds", created.GetId(), err)
		}
	}
	w.waitGone(created.GetId())
	step("delete: twice, then NOT_FOUND")
}

func (w *walk) create(request *pb.CreateInstanceRequest) *pb.Instance {
	answer, err := w.provider.CreateInstance(ctx(), request)
	if err != nil || answer.GetInstance().GetId() == "" {
		fail("Create of key %s answers an instance", request.GetKey(), err)
	}
	return answer.GetInstance()
}

func (w *walk) waitRunning(id string) *pb.Instance {
	deadline := time.Now().Add(w.running)
	for {
		answer, err := w.provider.GetInstance(ctx(), &pb.GetInstanceRequest{Id: id})
		if err != nil {
			fail("Get of %s succeeds", id, err)
		}
		instance := answer.GetInstance()
		if instance.GetState() == pb.InstanceState_INSTANCE_STATE_RUNNING && len(instance.GetAddresses()) > 0 {
			return instance
		}
		if time.Now().After(deadline) {
			fail("%s RUNNING with an address", id, fmt.Errorf("still %s", instance.GetState()))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// list walks ListInstances by the walk's tag in pages of 1, following next_page_token.
func (w *walk) list() []string {
	var ids []string
	token := ""
	size := uint32(1)
	for pages := 0; pages < 200; pages++ {
		answer, err := w.provider.ListInstances(ctx(), &pb.ListInstancesRequest{
			TagSelector: map[string]string{tagKey: "go"},
			PageSize:    &size,
			PageToken:   token,
		})
		if err != nil {
			fail("ListInstances page %s answers", fmt.Sprint(pages+1), err)
		}
		if len(answer.GetInstances()) > 1 {
			fail("at most %s instance per page", "1", fmt.Errorf("%d", len(answer.GetInstances())))
		}
		for _, instance := range answer.GetInstances() {
			ids = append(ids, instance.GetId())
		}
		token = answer.GetNextPageToken()
		if token == "" {
			return ids
		}
	}
	fail("a walk that ends within %s pages", "200", nil)
	return nil
}

func (w *walk) waitGone(id string) {
	deadline := time.Now().Add(w.running)
	for {
		answer, err := w.provider.GetInstance(ctx(), &pb.GetInstanceRequest{Id: id})
		if status.Code(err) == codes.NotFound {
			expectCode(err, codes.NotFound, "Get of a deleted instance")
			return
		}
		if err != nil || answer.GetInstance().GetState() != pb.InstanceState_INSTANCE_STATE_DELETING {
			fail("Get of deleted %s: DELETING, then NOT_FOUND", id, fmt.Errorf("%v %v", answer.GetInstance().GetState(), err))
		}
		if time.Now().After(deadline) {
			fail("%s gone", id, fmt.Errorf("still DELETING"))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// expectCode checks err's code and its ErrorInfo (domain egressproxy.dev, a reason),
// decoded from grpc-status-details-bin; returns the reason.
func expectCode(err error, code codes.Code, what string) string {
	if status.Code(err) != code {
		fail("%s: "+code.String(), what, err)
	}
	for _, detail := range status.Convert(err).Details() {
		if info, ok := detail.(*errdetails.ErrorInfo); ok {
			if info.GetDomain() != domain || info.GetReason() == "" {
				fail("%s: ErrorInfo of domain egressproxy.dev with a reason", what, fmt.Errorf("%s/%s", info.GetDomain(), info.GetReason()))
			}
			return info.GetReason()
		}
	}
	fail("%s: an ErrorInfo in the status details", what, err)
	return ""
}

// violates reports whether err's BadRequest names field.
func violates(err error, field string) bool {
	for _, detail := range status.Convert(err).Details() {
		if bad, ok := detail.(*errdetails.BadRequest); ok {
			for _, violation := range bad.GetFieldViolations() {
				if violation.GetField() == field {
					return true
				}
			}
		}
	}
	return false
}

func ctx() context.Context {
	c, _ := context.WithTimeout(context.Background(), 10*time.Second) //nolint:govet // one call each; the process is short-lived
	return c
}

func step(format string, args ...any) {
	fmt.Printf("ok: "+format+"\n", args...)
}

func fail(expected, subject string, err error) {
	fmt.Fprintf(os.Stderr, "go-client: expected "+expected+"; got %v\n", subject, err)
	os.Exit(1)
}
